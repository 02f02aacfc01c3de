"""Rows to token ids and answer flags, in batches, with progress lines on long work.

* A prompt/answer pair: ``leading + prompt + answer (+ eod)`` where ``leading`` is what the tokenizer's
  post-processor puts before a text (Llama 3's ``<|begin_of_text|>``; nothing for most), prompt and answer encoded
  without it: one BOS, at the start only. The flags are 1 on the answer (and eod).
* A chat: its rendering by the chat template, encoded without the post-processor's special tokens (the template
  writes them), so the ids equal transformers' ``apply_chat_template(messages, tokenize=True)``; the flags are 1
  on the assistant turns (:mod:`kubetron.data.sft.chat`).

The chat template is compiled once; texts go to the Rust tokenizer ``BATCH`` at a time (``encode_batch`` runs on
all cores) while Python renders the next batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jinja2
import numpy as np

from kubetron.contract.errors import ConfigError
from kubetron.data.sft.chat import ChatTemplate, token_mask
from kubetron.data.sft.rows import Chat, Pair

log = logging.getLogger("kubetron")

BATCH = 1024
PROGRESS_EVERY_S = 10.0


class Progress:
    """A log line with the rate and an ETA every `every` seconds of long work (none for work done sooner)."""

    def __init__(self, what: str, total: float, unit: str, every: float = PROGRESS_EVERY_S):
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.t0 = self.last = time.monotonic()

    def __call__(self, done: float) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        log.info("%s: %s of %s %s (%.0f%%, %.0f/s, ETA %s)", self.what, _count(done), _count(self.total), self.unit,
                 100 * done / max(self.total, 1), rate, _duration(eta))

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def _count(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e7 else f"{n:.0f}"


def _duration(s: float) -> str:
    if s != s or s == float("inf"):
        return "?"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}min"


@dataclass
class Encoded:
    """Every example's ids back to back: example i is ``tokens[offsets[i]:offsets[i + 1]]``, flags alike."""

    tokens: list[int] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])
    cut: int = 0
    short: int = 0

    def add(self, ids: list[int], flags: list[int], limit: int) -> None:
        self.cut += len(ids) > limit
        ids, flags = ids[:limit], flags[:limit]
        if len(ids) < 2:
            self.short += 1  # nothing to predict
            return
        self.tokens += ids
        self.flags += flags
        self.offsets.append(len(self.tokens))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"tokens": np.asarray(self.tokens, dtype=np.int32), "flags": np.asarray(self.flags, dtype=np.uint8),
                "offsets": np.asarray(self.offsets, dtype=np.int64)}


class Encoder:
    """Turns (where, example) items into ids and flags for one tokenizer and its chat templates."""

    def __init__(self, tokenizer, seq_length: int, add_eod: bool, template_name: str | None, field: str):
        self.tok, self.limit, self.add_eod, self.field = tokenizer, seq_length + 1, add_eod, field
        self.template_name = template_name
        self.leading = list(getattr(tokenizer, "leading_special_ids", ()))
        self._templates: dict[str, ChatTemplate] = {}

    def template(self, chat: Chat, where: str) -> ChatTemplate:
        templates = getattr(self.tok, "chat_templates", {})
        if not templates:
            raise ConfigError(self.field, f"{where}: chat messages need a tokenizer with a chat template "
                                          f"(chat_template.jinja or tokenizer_config.json's chat_template); "
                                          f"{self.tok!r} has none")
        name = choose_template(templates, self.template_name, chat.tools is not None)
        if name not in self._templates:
            tokens = getattr(self.tok, "template_tokens", {})
            specials = getattr(self.tok, "special_token_texts", ())
            self._templates[name] = ChatTemplate(self.tok.chat_templates[name], tokens, specials,
                                                 f"chat template {name!r}")
        return self._templates[name]

    def encode_all(self, items: list[tuple[str, Pair | Chat]], progress: Progress | None = None) -> Encoded:
        out = Encoded()
        with ThreadPoolExecutor(1, thread_name_prefix="kubetron-encode") as pool:
            pending = None
            for start in range(0, len(items), BATCH):
                batch = items[start:start + BATCH]
                prepared = self._prepare(batch)  # Python: render the chats while the Rust tokenizer runs
                if pending is not None:
                    self._collect(*pending.result(), out)
                pending = pool.submit(self._encode, batch, prepared)
                if progress:
                    progress(start)
            if pending is not None:
                self._collect(*pending.result(), out)
        return out

    def _prepare(self, batch: list[tuple[str, Pair | Chat]]) -> list:
        return [self._render(where, ex) if isinstance(ex, Chat) else ex for where, ex in batch]

    def _render(self, where: str, chat: Chat):
        template = self.template(chat, where)
        try:
            return template.spans(list(chat.messages), chat.trained, chat.tools)
        except jinja2.TemplateError as e:
            raise ConfigError(self.field, f"{where}: the chat template failed: {e}") from None
        except ValueError as e:
            raise ConfigError(self.field, f"{where}: {e}") from None

    def _encode(self, batch, prepared) -> tuple[list, list]:
        chats = [p for p in prepared if not isinstance(p, Pair)]
        pairs = [p for p in prepared if isinstance(p, Pair)]
        chat_enc = iter(self.tok.encode_offsets([text for text, _ in chats]) if chats else [])
        plain = iter(self.tok.encode_plain([t for p in pairs for t in (p.prompt, p.answer)]) if pairs else [])
        results = []
        for p in prepared:
            if isinstance(p, Pair):
                prompt, answer = next(plain), next(plain)
                ids = self.leading + prompt + answer + ([self.tok.eod] if self.add_eod else [])
                results.append((ids, [0] * (len(self.leading) + len(prompt)) + [1] * (len(ids) - len(self.leading)
                                                                                       - len(prompt))))
            else:
                enc = next(chat_enc)
                results.append((list(enc.ids), token_mask(enc, p[1])))
        return batch, results

    def _collect(self, batch, results, out: Encoded) -> None:
        for ids, flags in results:
            out.add(ids, flags, self.limit)


def choose_template(templates: dict[str, str], name: str | None, has_tools: bool) -> str:
    """The template a chat is rendered with, chosen as transformers' get_chat_template chooses (the configured
    name, else "tool_use" for a chat with tools when there is one, else "default")."""
    if name is not None:
        if name not in templates:
            raise ConfigError("finetuning.chat_template", f"{name!r}: the tokenizer has no chat template of that name "
                                                          f"(it has {', '.join(sorted(templates))})")
        return name
    if has_tools and "tool_use" in templates:
        return "tool_use"
    if "default" not in templates:
        raise ConfigError("finetuning.chat_template", f"the tokenizer has chat templates {', '.join(sorted(templates))}"
                                                      " and none named 'default': choose one")
    return "default"


def parse_all(rows: Iterable[tuple[str, object]], parse, field: str) -> list[tuple[str, Pair | Chat]]:
    """Every row as an example; a bad row is a ConfigError naming FILE:LINE and what is wrong."""
    out = []
    for where, row in rows:
        try:
            out.append((where, parse(row)))
        except ValueError as e:
            raise ConfigError(field, f"{where}: {e}") from None
    return out
