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
An example longer than `seq_length + 1` tokens is cut to that length; one with no trained token left after the cut
is dropped (as TRL drops it), and a dataset with none left is refused naming ``model.seq_length``. The data line
counts examples, dropped, cut and trained tokens (``kubetron inspect-data`` prints it and the examples).

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
    max_expansion: int = files.DEFAULT_EXPANSION  # a bound on reading, not a shape of the samples: not in the key

    def key_part(self) -> dict:
        return {"seq_length": self.seq_length, "packing": self.packing, "add_eod": self.add_eod,
                "keys": [self.keys.input, self.keys.output, self.keys.messages], "chat_template": self.chat_template}


@dataclass(frozen=True)
class Built:
    """What a build made: the flat arrays a FinetuningDataset serves, the counts of the data line, and for each
    kept example where its row was (``FILE:LINE``; in memory only, for inspect-data)."""

    arrays: dict[str, np.ndarray]
    counts: dict
    where: list[str]


def build(paths, tokenizer, s: SftSettings, field: str) -> Built:
    """Read, tokenize, drop what has nothing to train, pack."""
    found = files.resolve(paths, field)
    total = sum(f.size for f in found)
    rows = files.read_rows(found, field, Progress(f"{field}: reading", total, "bytes"), s.max_expansion)
    items = parse_all(rows, lambda row: parse_row(row, s.keys), field)
    if not items:
        raise ConfigError(field, f"{_name(paths)}: holds no examples")
    encoded = encode_all(tokenizer, (s.seq_length, s.add_eod, s.chat_template, field), items,
                         Progress(f"{field}: tokenizing", len(items), "examples"))
    if not encoded.kept_rows:
        raise ConfigError(*_nothing_to_train(paths, len(items), encoded, s.seq_length, field))
    if encoded.no_system:
        log.warning("%s: the chat template leaves out the system message of %d of the %d examples (it writes it "
                    "only in some positions: Mistral v0.3's only when the conversation ends with a user turn); they "
                    "train without it", _name(paths), encoded.no_system, len(items))
    arrays = encoded.arrays()
    groups = pack(np.diff(arrays["offsets"]) - 1, s.seq_length, s.packing)
    arrays["groups"] = np.asarray([i for g in groups for i in g], dtype=np.int64)
    arrays["group_offsets"] = np.cumsum([0] + [len(g) for g in groups], dtype=np.int64)
    counts = {"rows": len(items), "dropped": encoded.dropped, "dropped_cut": encoded.dropped_cut,
              "cut": encoded.cut, "trained_tokens": int(arrays["flags"][1:].sum()) - _first_flags(arrays)}
    return Built(arrays, counts, [items[i][0] for i in encoded.kept_rows])


def build_arrays(paths, tokenizer, s: SftSettings, field: str) -> tuple[dict[str, np.ndarray], dict]:
    """Read, tokenize and pack: the flat arrays a FinetuningDataset serves, and counts for the log."""
    built = build(paths, tokenizer, s, field)
    return built.arrays, built.counts


def _first_flags(arrays: dict[str, np.ndarray]) -> int:
    """Flags of each example's first id after the very first (never a target: no position predicts it)."""
    starts = arrays["offsets"][1:-1]
    return int(arrays["flags"][starts].sum()) if len(starts) else 0


def _nothing_to_train(paths, rows: int, e, seq_length: int, field: str) -> tuple[str, str]:
    if e.dropped_cut:
        return "model.seq_length", (f"{_name(paths)}: no example has a token to train within seq_length {seq_length}: "
                                    f"{e.dropped_cut} of the {rows} are cut at seq_length + 1 = {seq_length + 1} "
                                    "tokens before their answer (the rest have no answer); raise model.seq_length or "
                                    "shorten the prompts")
    return field, f"{_name(paths)}: none of the {rows} examples has a token to train (empty answers)"


def data_line(paths, counts: dict, sequences: int, seq_length: int, packing: bool, real: int) -> str:
    """The one line a build logs: examples, dropped, cut, trained tokens, sequences and how full they are."""
    kept = counts["rows"] - counts.get("dropped", 0)
    dropped = counts.get("dropped", 0)
    why = (f"; {dropped} dropped with nothing to train ({counts.get('dropped_cut', 0)} after the cut at "
           f"seq_length)" if dropped else "")
    return (f"{_name(paths)}: {kept} examples{why}; {counts.get('cut', 0)} cut at seq_length; "
            f"{counts.get('trained_tokens', 0)} trained tokens; in {sequences} sequences of {seq_length} "
            f"({'packed' if packing else 'padded'}; {100 * real / max(sequences * seq_length, 1):.0f}% of positions "
            "are real tokens)")


def _name(paths) -> str:
    return paths if isinstance(paths, str) else ", ".join(paths)


class FinetuningDataset:
    """Sequences of `seq_length` positions built from fine-tuning rows; indexable without end (epochs).

    `cache_at`: where to store the built arrays and load them from (a kubetron.data.sft.cache.CachePlace); None
    builds them in memory."""

    def __init__(self, path, tokenizer, seq_length: int, *, packing: bool, seed: int, shuffle: bool = True,
                 add_eod: bool = True, input_key: str = "input", output_key: str = "output",
                 messages_key: str = "messages", chat_template: str | None = None,
                 max_expansion: int = files.DEFAULT_EXPANSION, field: str = "finetuning.data_path",
                 cache_at: cache.CachePlace | None = None):
        self.seq_length, self.packing, self.seed, self.shuffle = seq_length, packing, seed, shuffle
        pad = getattr(tokenizer, "pad", None)  # tokenizers without a pad token pad with eod (no loss there)
        self.pad = int(tokenizer.eod if pad is None else pad)
        keys = RowKeys(input_key, output_key, messages_key)
        settings = SftSettings(seq_length, packing, add_eod, keys, chat_template, max_expansion)
        t0 = time.monotonic()

        def make():
            return build_arrays(path, tokenizer, settings, field)

        if cache_at is None:
            (arrays, meta), how = make(), "built in memory"
        else:
            key = cache.cache_key(files.resolve(path, field), tokenizer, settings.key_part())
            arrays, meta, how = cache.load_or_build(cache_at, key, tokenizer.vocab_size, make, field)
        self._serve(arrays)
        self.counts = meta
        real = int(self.offsets[-1]) - (len(self.offsets) - 1)
        self.line = data_line(path, meta, len(self), seq_length, packing, real)
        log.info("%s; %s in %.1fs", self.line, how, time.monotonic() - t0)

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


def settings_of(cfg) -> SftSettings:
    """The settings of a run config's `finetuning` section (and model.seq_length)."""
    ft = cfg.finetuning
    return SftSettings(cfg.model.seq_length, ft.packing, ft.add_eod, RowKeys(ft.input_key, ft.output_key,
                                                                              ft.messages_key),
                       ft.chat_template, ft.max_expansion)


def build_finetuning_datasets(cfg, tokenizer) -> dict:
    """``{"train", "valid", "test"}`` for the `finetuning` section (test: None)."""
    ft = cfg.finetuning
    common = dict(packing=ft.packing, seed=cfg.rng.seed, shuffle=ft.shuffle, add_eod=ft.add_eod,
                  input_key=ft.input_key, output_key=ft.output_key, messages_key=ft.messages_key,
                  chat_template=ft.chat_template, max_expansion=ft.max_expansion,
                  cache_at=cache.cache_location(ft.cache_dir, cfg.checkpoint.save))
    train = FinetuningDataset(ft.data_path, tokenizer, cfg.model.seq_length, **common)
    valid = None
    if ft.valid_data_path:
        valid = FinetuningDataset(ft.valid_data_path, tokenizer, cfg.model.seq_length,
                                  field="finetuning.valid_data_path", **common)
    return {"train": train, "valid": valid, "test": None}
