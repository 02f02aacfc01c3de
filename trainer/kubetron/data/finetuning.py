"""Supervised fine-tuning data: chats and prompt/answer rows, padded or packed (the `finetuning` section).

Rows (:mod:`kubetron.data.sft.rows`: OpenAI messages, TRL prompt/completion, ShareGPT, input/output) are read
from files (:mod:`kubetron.data.sft.files`: JSON Lines plain/gz/zst, Parquet, Arrow, datasets directories, globs,
lists, s3://) and turned into ids with answer flags (:mod:`kubetron.data.sft.encode`): a chat is its chat
template's rendering, encoded as transformers' ``apply_chat_template(tokenize=True)`` encodes it, trained on its
assistant turns; a prompt/answer pair is ``prompt + answer (+ eod)`` with one BOS at the start when the tokenizer
adds one, trained on the answer. An example's ``n`` ids give ``n - 1`` (token, label) pairs, and the loss mask is
1 exactly where the label is an answer token, so the model is never trained to produce the prompt.

Sequences (one sample = `seq_length` positions):
- padding: one example per sequence, then `pad` tokens with loss mask 0 (causal attention never
  lets a real token see the padding after it);
- packing: examples first-fit into sequences, each with position ids starting at 0 and a
  `segment_ids` row (1, 2, ... per example, 0 for the tail padding). The forward step turns it into
  a block-diagonal causal mask (gpt_step.document_mask), so no token attends across examples.
An example longer than `seq_length + 1` tokens is cut to that length (counted in the log).

Built once (:mod:`kubetron.data.sft.cache`): rank 0 tokenizes and packs and stores the result; the other ranks
and every restart load it.

Order: the sequences are built once; each epoch visits them in a permutation seeded by
``rng.seed`` and the epoch number, so sample ``i`` is a pure function of ``i`` (exact resume through
the loader's ``consumed_samples``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from kubetron.contract.errors import ConfigError
from kubetron.data.sft import cache, files
from kubetron.data.sft.encode import Progress, encode_all, parse_all
from kubetron.data.sft.rows import RowKeys, parse_row

log = logging.getLogger("kubetron")

_OPEN_BINS = 64


def pack(lengths: np.ndarray, seq_length: int, packing: bool) -> list[list[int]]:
    """Groups of example indices, one per sequence: padding one each; packing first fit, in order,
    over the most recent `_OPEN_BINS` sequences (bounded work per example, near-full sequences)."""
    if not packing:
        return [[i] for i in range(len(lengths))]
    groups: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths.tolist()):
        first = max(0, len(groups) - _OPEN_BINS)
        fit = next((j for j in range(first, len(groups)) if free[j] >= n), None)
        if fit is None:
            groups.append([])
            free.append(seq_length)
            fit = len(groups) - 1
        groups[fit].append(i)
        free[fit] -= n
    return groups


@dataclass(frozen=True)
class SftSettings:
    """Everything besides the data and the tokenizer that shapes the samples (part of the cache key)."""

    seq_length: int
    packing: bool
    add_eod: bool = True
    keys: RowKeys = RowKeys()
    chat_template: str | None = None

    def key_part(self) -> dict:
        return {"seq_length": self.seq_length, "packing": self.packing, "add_eod": self.add_eod,
                "keys": [self.keys.input, self.keys.output, self.keys.messages], "chat_template": self.chat_template}


def build_arrays(paths, tokenizer, s: SftSettings, field: str) -> tuple[dict[str, np.ndarray], dict]:
    """Read, tokenize and pack: the flat arrays a FinetuningDataset serves, and counts for the log."""
    found = files.resolve(paths, field)
    total = sum(f.size for f in found)
    rows = files.read_rows(found, field, Progress(f"{field}: reading", total, "bytes"))
    items = parse_all(rows, lambda row: parse_row(row, s.keys), field)
    if not items:
        raise ConfigError(field, f"{_name(paths)}: holds no examples")
    encoded = encode_all(tokenizer, (s.seq_length, s.add_eod, s.chat_template, field), items,
                         Progress(f"{field}: tokenizing", len(items), "examples"))
    arrays = encoded.arrays()
    if len(arrays["offsets"]) < 2:
        raise ConfigError(field, f"{_name(paths)}: no example has two or more tokens")
    groups = pack(np.diff(arrays["offsets"]) - 1, s.seq_length, s.packing)
    arrays["groups"] = np.asarray([i for g in groups for i in g], dtype=np.int64)
    arrays["group_offsets"] = np.cumsum([0] + [len(g) for g in groups], dtype=np.int64)
    return arrays, {"rows": len(items), "cut": encoded.cut, "short": encoded.short}


def _name(paths) -> str:
    return paths if isinstance(paths, str) else ", ".join(paths)


class FinetuningDataset:
    """Sequences of `seq_length` positions built from fine-tuning rows; indexable without end (epochs).

    `cache`: (location, shared) to store the built arrays in and load them from (see kubetron.data.sft.cache);
    None builds them in memory."""

    def __init__(self, path, tokenizer, seq_length: int, *, packing: bool, seed: int, shuffle: bool = True,
                 add_eod: bool = True, input_key: str = "input", output_key: str = "output",
                 messages_key: str = "messages", chat_template: str | None = None,
                 field: str = "finetuning.data_path", cache_at: tuple[str, bool] | None = None):
        self.seq_length, self.packing, self.seed, self.shuffle = seq_length, packing, seed, shuffle
        pad = getattr(tokenizer, "pad", None)  # tokenizers without a pad token pad with eod (no loss there)
        self.pad = int(tokenizer.eod if pad is None else pad)
        keys = RowKeys(input_key, output_key, messages_key)
        settings = SftSettings(seq_length, packing, add_eod, keys, chat_template)
        t0 = time.monotonic()

        def build():
            return build_arrays(path, tokenizer, settings, field)

        if cache_at is None:
            (arrays, meta), how = build(), "built in memory"
        else:
            key = cache.cache_key(files.resolve(path, field), tokenizer, settings.key_part())
            arrays, meta, how = cache.load_or_build(*cache_at, key, tokenizer.vocab_size, build, field)
        self._serve(arrays)
        real = int(self.offsets[-1]) - (len(self.offsets) - 1)
        log.info("%s: %d examples in %d sequences of %d (%s; %.0f%% of positions are real tokens; %d cut at "
                 "seq_length); %s in %.1fs", _name(path), len(self.offsets) - 1, len(self), seq_length,
                 "packed" if packing else "padded", 100 * real / (len(self) * seq_length), meta.get("cut", 0), how,
                 time.monotonic() - t0)

    def _serve(self, a: dict[str, np.ndarray]) -> None:
        self.tokens, self.flags, self.offsets = a["tokens"], a["flags"], a["offsets"]
        self._groups, self._group_offsets = a["groups"], a["group_offsets"]

    def __len__(self) -> int:
        return len(self._group_offsets) - 1

    def group(self, n: int) -> np.ndarray:
        """The examples of sequence n (before shuffling), in the order they are packed."""
        return self._groups[self._group_offsets[n]:self._group_offsets[n + 1]]

    def example(self, i: int) -> dict[str, np.ndarray]:
        """tokens/labels/loss_mask of example i (n ids -> n - 1 positions; loss where the label is an answer)."""
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return {"tokens": self.tokens[lo:hi - 1], "labels": self.tokens[lo + 1:hi],
                "loss_mask": self.flags[lo + 1:hi].astype(np.float32)}

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self))
        return np.random.RandomState((self.seed + 7919 * epoch) % 2**32).permutation(len(self))

    def sequence(self, group) -> dict[str, np.ndarray]:
        T = self.seq_length
        out: dict[str, np.ndarray] = {
            "tokens": np.full(T, self.pad, np.int64), "labels": np.full(T, self.pad, np.int64),
            "loss_mask": np.zeros(T, np.float32), "position_ids": np.arange(T, dtype=np.int64)}
        if self.packing:
            out["segment_ids"] = np.zeros(T, np.int64)
        pos = 0
        for seg, i in enumerate(group, 1):
            ex = self.example(int(i))
            n = len(ex["tokens"])
            for key in ("tokens", "labels", "loss_mask"):
                out[key][pos:pos + n] = ex[key]
            out["position_ids"][pos:pos + n] = np.arange(n)
            if self.packing:
                out["segment_ids"][pos:pos + n] = seg
            pos += n
        if pos < T:  # tail padding continues the positions (no loss; no real token attends to it)
            out["position_ids"][pos:] = np.arange(T - pos)
        return out

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        epoch, i = divmod(int(idx), len(self))
        return self.sequence(self.group(int(self._order(epoch)[i])))


def build_finetuning_datasets(cfg, tokenizer) -> dict:
    """``{"train", "valid", "test"}`` for the `finetuning` section (test: None)."""
    ft = cfg.finetuning
    common = dict(packing=ft.packing, seed=cfg.rng.seed, shuffle=ft.shuffle, add_eod=ft.add_eod,
                  input_key=ft.input_key, output_key=ft.output_key, messages_key=ft.messages_key,
                  chat_template=ft.chat_template, cache_at=cache.cache_location(ft.cache_dir, cfg.checkpoint.save))
    train = FinetuningDataset(ft.data_path, tokenizer, cfg.model.seq_length, **common)
    valid = None
    if ft.valid_data_path:
        valid = FinetuningDataset(ft.valid_data_path, tokenizer, cfg.model.seq_length,
                                  field="finetuning.valid_data_path", **common)
    return {"train": train, "valid": valid, "test": None}
