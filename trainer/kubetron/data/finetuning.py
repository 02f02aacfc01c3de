"""Supervised fine-tuning data: JSONL prompt/answer pairs, padded or packed (the `finetuning` section).

Each line is a JSON object with the prompt under `input_key` and the answer under `output_key`, or
a chat under `messages_key` (a list of {role, content}), rendered with the tokenizer's chat template
as transformers renders it; its answer tokens are every assistant turn's rendered text.
An example's token sequence is ``prompt + answer (+ eod)``; it gives ``n - 1`` (token, label) pairs,
and the loss mask is 1 exactly where the label is an answer token, so the model is never trained
to produce the prompt.

Sequences (one sample = `seq_length` positions):
- padding: one example per sequence, then `pad` tokens with loss mask 0 (causal attention never
  lets a real token see the padding after it);
- packing: examples first-fit into sequences, each with position ids starting at 0 and a
  `segment_ids` row (1, 2, ... per example, 0 for the tail padding). The forward step turns it into
  a block-diagonal causal mask (gpt_step.document_mask), so no token attends across examples.
An example longer than `seq_length + 1` tokens is cut to that length (counted in the log).

Order: the sequences are built once; each epoch visits them in a permutation seeded by
``rng.seed`` and the epoch number, so sample ``i`` is a pure function of ``i`` (exact resume through
the loader's ``consumed_samples``).
"""

from __future__ import annotations

import json
import logging

import numpy as np

from kubetron.contract.errors import ConfigError

log = logging.getLogger("kubetron")


def read_examples(path: str, field: str, input_key: str, output_key: str,
                  messages_key: str) -> list[tuple[str, str] | list[dict]]:
    """(prompt, answer) pairs or chat message lists; a bad line is a ConfigError naming file and line."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise ConfigError(field, f"{path}:{lineno}: not a JSON object ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise ConfigError(field, f"{path}:{lineno}: not a JSON object")
                if messages_key in obj:
                    out.append(_messages(obj[messages_key], f"{path}:{lineno}", field, messages_key))
                    continue
                for key in (input_key, output_key):
                    if not isinstance(obj.get(key), str):
                        what = "has no" if key not in obj else "has a non-string"
                        raise ConfigError(field, f"{path}:{lineno}: {what} {key!r} key")
                out.append((obj[input_key], obj[output_key]))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(field, f"{path}: cannot read: {e}") from None
    if not out:
        raise ConfigError(field, f"{path}: holds no examples")
    return out


def _messages(msgs, where: str, field: str, key: str) -> list[dict]:
    ok = isinstance(msgs, list) and msgs and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)
    if not ok:
        raise ConfigError(field, f"{where}: {key!r} must be a list of {{role, content}} strings")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ConfigError(field, f"{where}: {key!r} has no assistant message (nothing to learn)")
    return msgs


def tokenize(tokenizer, prompt: str, answer: str, add_eod: bool) -> tuple[list[int], list[int]]:
    """(ids, answer flags) of one prompt/answer pair."""
    p = list(tokenizer.encode(prompt))
    a = list(tokenizer.encode(answer)) + ([tokenizer.eod] if add_eod else [])
    return p + a, [0] * len(p) + [1] * len(a)


def _token_text(tokenizer, token_id) -> str:
    inner = getattr(tokenizer, "_tok", None)  # tokenizers.Tokenizer inside HuggingFaceTokenizer
    return inner.id_to_token(token_id) or "" if inner is not None and token_id is not None else ""


def tokenize_chat(tokenizer, messages: list[dict], where: str, field: str) -> tuple[list[int], list[int]]:
    """A conversation rendered with the tokenizer's chat template (as transformers renders it); answer
    flags on every assistant turn's rendered text, 0 on everything else."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError(field, f"{where}: chat messages need a tokenizer with a chat template "
                                 f"(tokenizer_config.json chat_template); {tokenizer!r} has none")
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def fail(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tpl = env.from_string(template)
    extra = {"bos_token": _token_text(tokenizer, getattr(tokenizer, "bos", None)),
             "eos_token": _token_text(tokenizer, tokenizer.eod), "raise_exception": fail}

    def render(msgs, gen: bool) -> str:
        try:
            return tpl.render(messages=msgs, add_generation_prompt=gen, **extra)
        except TemplateError as e:
            raise ConfigError(field, f"{where}: the chat template failed: {e}") from None

    # Text spans, alternately context and an assistant turn: the rendering of the first i messages
    # (with the generation prompt) is a prefix of the rendering of the first i + 1.
    spans, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if not (before.startswith(done) and through.startswith(before)):
            raise ConfigError(field, f"{where}: the chat template does not render turns as prefixes")
        spans += [(before[len(done):], 0), (through[len(before):], 1)]
        done = through
    spans.append((render(messages, False)[len(done):], 0))
    ids, flags = [], []
    for text, flag in spans:
        piece = list(tokenizer.encode(text)) if text else []
        ids += piece
        flags += [flag] * len(piece)
    return ids, flags


def example_arrays(ids: list[int], answer: list[int]) -> dict[str, np.ndarray]:
    """tokens/labels/loss_mask/position_ids of one example (n ids -> n - 1 positions): the loss is
    taken where the label is an answer token."""
    ids_np = np.asarray(ids, dtype=np.int64)
    n = len(ids) - 1
    return {"tokens": ids_np[:-1], "labels": ids_np[1:],
            "loss_mask": np.asarray(answer[1:], dtype=np.float32),
            "position_ids": np.arange(n, dtype=np.int64)}


_OPEN_BINS = 64


def pack(examples: list[dict[str, np.ndarray]], seq_length: int, packing: bool) -> list[list[int]]:
    """Groups of example indices, one per sequence: padding one each; packing first fit, in order,
    over the most recent `_OPEN_BINS` sequences (bounded work per example, near-full sequences)."""
    if not packing:
        return [[i] for i in range(len(examples))]
    groups: list[list[int]] = []
    free: list[int] = []
    for i, ex in enumerate(examples):
        n = len(ex["tokens"])
        first = max(0, len(groups) - _OPEN_BINS)
        fit = next((j for j in range(first, len(groups)) if free[j] >= n), None)
        if fit is None:
            groups.append([])
            free.append(seq_length)
            fit = len(groups) - 1
        groups[fit].append(i)
        free[fit] -= n
    return groups


class FinetuningDataset:
    """Sequences of `seq_length` positions built from a JSONL file; indexable without end (epochs)."""

    def __init__(self, path: str, tokenizer, seq_length: int, *, packing: bool, seed: int, shuffle: bool = True,
                 add_eod: bool = True, input_key: str = "input", output_key: str = "output",
                 messages_key: str = "messages", field: str = "finetuning.data_path"):
        self.seq_length, self.packing, self.seed, self.shuffle = seq_length, packing, seed, shuffle
        pad = getattr(tokenizer, "pad", None)  # tokenizers without a pad token pad with eod (no loss there)
        self.pad = int(tokenizer.eod if pad is None else pad)
        examples, cut = [], 0
        for n, ex in enumerate(read_examples(path, field, input_key, output_key, messages_key), 1):
            ids, answer = tokenize_chat(tokenizer, ex, f"{path} example {n}", field) if isinstance(ex, list) \
                else tokenize(tokenizer, *ex, add_eod)
            cut += len(ids) > seq_length + 1
            ids, answer = ids[:seq_length + 1], answer[:seq_length + 1]
            if len(ids) < 2:
                continue  # nothing to predict
            examples.append(example_arrays(ids, answer))
        if not examples:
            raise ConfigError(field, f"{path}: no example has two or more tokens")
        self.examples = examples
        self.groups = pack(examples, seq_length, packing)
        self.num_tokens = sum(len(e["tokens"]) for e in examples)
        log.info("%s: %d examples in %d sequences of %d (%s; %.0f%% of positions are real tokens; %d cut "
                 "at seq_length)", path, len(examples), len(self.groups), seq_length,
                 "packed" if packing else "padded", 100 * self.num_tokens / (len(self.groups) * seq_length), cut)

    def __len__(self) -> int:
        return len(self.groups)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.groups))
        return np.random.RandomState((self.seed + 7919 * epoch) % 2**32).permutation(len(self.groups))

    def sequence(self, group: list[int]) -> dict[str, np.ndarray]:
        T = self.seq_length
        out = {"tokens": np.full(T, self.pad, np.int64), "labels": np.full(T, self.pad, np.int64),
               "loss_mask": np.zeros(T, np.float32), "position_ids": np.arange(T, dtype=np.int64)}
        if self.packing:
            out["segment_ids"] = np.zeros(T, np.int64)
        pos = 0
        for seg, i in enumerate(group, 1):
            ex = self.examples[i]
            n = len(ex["tokens"])
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                out[key][pos:pos + n] = ex[key]
            if self.packing:
                out["segment_ids"][pos:pos + n] = seg
            pos += n
        if pos < T:  # tail padding continues the positions (no loss; no real token attends to it)
            out["position_ids"][pos:] = np.arange(T - pos)
        return out

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        epoch, i = divmod(int(idx), len(self.groups))
        return self.sequence(self.groups[self._order(epoch)[i]])


def build_finetuning_datasets(cfg, tokenizer) -> dict:
    """``{"train", "valid", "test"}`` for the `finetuning` section (test: None)."""
    ft = cfg.finetuning
    common = dict(packing=ft.packing, seed=cfg.rng.seed, shuffle=ft.shuffle, add_eod=ft.add_eod,
                  input_key=ft.input_key, output_key=ft.output_key, messages_key=ft.messages_key)
    train = FinetuningDataset(ft.data_path, tokenizer, cfg.model.seq_length, **common)
    valid = None
    if ft.valid_data_path:
        valid = FinetuningDataset(ft.valid_data_path, tokenizer, cfg.model.seq_length,
                                  field="finetuning.valid_data_path", **common)
    return {"train": train, "valid": valid, "test": None}
