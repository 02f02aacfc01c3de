"""Rows to token ids and answer flags, in batches, with progress lines on long work.

* A prompt/answer pair, as TRL's SFTTrainer encodes a prompt/completion row: ``prompt + answer`` encoded as one text
  (with the post-processor's special tokens: one BOS, at the start), then eod when ``add_eod`` and the text does not
  end with it; the flags are 1 from where the ids of the prompt alone stop matching (TRL's
  ``common_prefix_length``): no token is invented at the boundary ("A:" + "Paris" is "A:Paris", never "A: Paris").
* A chat: its rendering by the chat template, encoded without the post-processor's special tokens (the template
  writes them), so the ids equal transformers' ``apply_chat_template(messages, tokenize=True)``; the flags are 1
  on the assistant turns (:mod:`kubetron.data.sft.chat`).

An example is cut at ``seq_length + 1`` ids; one with no trained token left (its answer past the cut, or no answer)
is dropped and counted.

The chat template is compiled once per process; the examples go ``BATCH`` at a time to processes on all cores
(each renders its batch and encodes it in one call to the Rust tokenizer); a little data stays in this process.
The workers are this module's own processes (``python -m kubetron.data.sft.worker``), talking over their pipes.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain

import jinja2
import numpy as np

from kubetron.contract.errors import ConfigError
from kubetron.data.sft.chat import ChatTemplate, token_mask
from kubetron.data.sft.rows import Chat, Pair
from kubetron.data.tokenizer import FILE_TOKENIZERS, build_tokenizer, tokenizer_from_assets

log = logging.getLogger("kubetron")

BATCH = 1024
MAX_WORKERS = 32
PROGRESS_EVERY_S = 10.0


class Progress:
    """A log line with the rate and an ETA every `every` seconds of long work (none for work done sooner)."""

    def __init__(self, what: str, total: float, unit: str, every: float | None = None):
        self.what, self.total, self.unit = what, total, unit
        self.every = PROGRESS_EVERY_S if every is None else every
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
    """Every example's ids back to back, in chunks: example i's ids and flags, lengths in order."""

    ids: list[np.ndarray] = field(default_factory=list)
    flags: list[np.ndarray] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    cut: int = 0  # kept, cut at seq_length + 1
    dropped_cut: int = 0  # nothing left to train after the cut
    dropped_empty: int = 0  # nothing to train at all (an empty answer without eod, under two tokens)
    no_system: int = 0  # chats whose system message the template does not write
    kept_rows: list[int] = field(default_factory=list)  # which items of the batch were kept, in order

    def extend(self, other: Encoded, offset: int = 0) -> None:
        self.ids += other.ids
        self.flags += other.flags
        self.lengths += other.lengths
        self.cut += other.cut
        self.dropped_cut += other.dropped_cut
        self.dropped_empty += other.dropped_empty
        self.no_system += other.no_system
        self.kept_rows += [offset + i for i in other.kept_rows]

    @property
    def dropped(self) -> int:
        return self.dropped_cut + self.dropped_empty

    def arrays(self) -> dict[str, np.ndarray]:
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        return {"tokens": np.concatenate(self.ids or [np.zeros(0, np.int32)]).astype(np.int32),
                "flags": np.concatenate(self.flags or [np.zeros(0, np.uint8)]).astype(np.uint8),
                "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}


class Encoder:
    """Turns (where, example) items into ids and flags for one tokenizer and its chat templates."""

    def __init__(self, tokenizer, seq_length: int, add_eod: bool, template_name: str | None, field: str):
        self.tok, self.limit, self.add_eod, self.field = tokenizer, seq_length + 1, add_eod, field
        self.template_name = template_name
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

    def encode(self, batch: list[tuple[str, Pair | Chat]]) -> Encoded:
        """One batch: render its chats, encode every text in one call to the tokenizer, cut at seq_length + 1,
        drop what has nothing to train."""
        prepared = [self._render(where, ex) if isinstance(ex, Chat) else ex for where, ex in batch]
        chats = [p for p in prepared if not isinstance(p, Pair)]
        pairs = [p for p in prepared if isinstance(p, Pair)]
        chat_enc = iter(self.tok.encode_offsets([text for text, _ in chats]) if chats else [])
        plain = iter(self.tok.encode_batch([t for p in pairs for t in (p.prompt, p.prompt + p.answer)])
                     if pairs else [])
        out = Encoded()
        kept: list[tuple[list[int], list[int]]] = []
        for n, (p, (_, ex)) in enumerate(zip(prepared, batch, strict=True)):
            if isinstance(p, Pair):
                ids, flags = self._pair(next(plain), next(plain))
            else:
                enc = next(chat_enc)
                ids, flags = list(enc.ids), token_mask(enc, p[1])
                assert isinstance(ex, Chat)
                out.no_system += _drops_system(ex, p[0])
            if not any(flags[1:]):  # the first id is never a target
                out.dropped_empty += 1
                continue
            if len(ids) > self.limit:
                ids, flags = ids[:self.limit], flags[:self.limit]
                if not any(flags[1:]):
                    out.dropped_cut += 1
                    continue
                out.cut += 1
            kept.append((ids, flags))
            out.kept_rows.append(n)
        lengths = [len(ids) for ids, _ in kept]
        out.ids = [np.fromiter(chain.from_iterable(ids for ids, _ in kept), np.int32, sum(lengths))]
        out.flags = [np.fromiter(chain.from_iterable(flags for _, flags in kept), np.uint8, sum(lengths))]
        out.lengths = [np.asarray(lengths, dtype=np.int64)]
        return out

    def _pair(self, prompt: list[int], whole: list[int]) -> tuple[list[int], list[int]]:
        """TRL's prompt/completion ids: the whole text's, eod added; trained from where the prompt's ids stop."""
        ids = list(whole)
        if self.add_eod and (not ids or ids[-1] != self.tok.eod):
            ids.append(self.tok.eod)
        start = next((i for i, (a, b) in enumerate(zip(prompt, ids)) if a != b), min(len(prompt), len(ids)))
        return ids, [0] * start + [1] * (len(ids) - start)

    def _render(self, where: str, chat: Chat):
        try:
            return self.template(chat, where).spans(list(chat.messages), chat.trained, chat.tools)
        except ValueError as e:  # cannot be traced (chat.py words it)
            raise ConfigError(self.field, f"{where}: {e}") from None
        except jinja2.TemplateError as e:  # raise_exception(...), a bound passed, an undefined name
            raise ConfigError(self.field, f"{where}: the chat template failed: {_one_line(e)}") from None
        except Exception as e:  # the template's Python: 'a' + None, a dict where a string goes
            raise ConfigError(self.field, f"{where}: the chat template failed: {type(e).__name__}: "
                                          f"{_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


def _drops_system(chat: Chat, text: str) -> int:
    """1 when the chat has a system message with text that the rendering does not hold."""
    system = next((m.get("content") for m in chat.messages if m.get("role") == "system"), None)
    return int(isinstance(system, str) and bool(system.strip()) and system.strip() not in text)


def encode_all(tokenizer, settings: tuple, items: list[tuple[str, Pair | Chat]], progress: Progress | None = None,
               workers: int | None = None) -> Encoded:
    """Every item, BATCH at a time: in this process for little data, else on all cores (worker processes started as
    ``python -m kubetron.data.sft.worker``, each with its own copy of the tokenizer, rendering and encoding whole
    batches; started fresh, they never import the calling program, so a script without a main guard works). Should
    the workers fail, it goes on in this process, with a warning."""
    batches = [items[i:i + BATCH] for i in range(0, len(items), BATCH)]
    workers = min(workers or available_cpus(), MAX_WORKERS, len(batches))
    out = Encoded()
    if workers > 1 and tokenizer.tokenizer_type in FILE_TOKENIZERS + ("byte",):
        try:
            for n, result in enumerate(_in_workers(tokenizer, settings, batches, workers)):
                out.extend(result, n * BATCH)
                if progress:
                    progress(min(len(out.lengths) * BATCH, len(items)))
            return out
        except WorkerFailed as e:
            log.warning("tokenizing in %d processes failed (%s); going on in this one", workers, e)
            out = Encoded()
    encoder = Encoder(tokenizer, *settings)
    for n, batch in enumerate(batches, 1):
        out.extend(encoder.encode(batch), (n - 1) * BATCH)
        if progress:
            progress(min(n * BATCH, len(items)))
    return out


class WorkerFailed(RuntimeError):
    """A worker process ended or answered out of turn."""


def _in_workers(tokenizer, settings: tuple, batches: list, workers: int):
    """Batch i goes to worker i % workers (a thread per worker feeds it, so no pipe fills up while the results are
    read in order); the results come back in order."""
    init = (tokenizer.tokenizer_type, tokenizer.assets(), settings)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",  # one process per core already
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    procs = [subprocess.Popen([sys.executable, "-m", "kubetron.data.sft.worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env) for _ in range(workers)]
    feeders = [threading.Thread(target=_feed, args=(p, init, batches[w::workers]), daemon=True)
               for w, p in enumerate(procs)]
    try:
        for t in feeders:
            t.start()
        for n in range(len(batches)):
            result = _receive(procs[n % workers])
            if isinstance(result, tuple):  # a ConfigError, sent back as (field, message)
                raise ConfigError(*result)
            yield result
    finally:
        for p in procs:
            p.kill()
            p.wait()
            for pipe in (p.stdin, p.stdout):
                assert pipe is not None
                pipe.close()


def _feed(proc, init: tuple, batches: list) -> None:
    try:
        for message in (init, *batches):
            _send(proc.stdin, message)
        proc.stdin.close()
    except (BrokenPipeError, OSError, ValueError):  # the worker ended (its reader says why)
        pass


def _send(pipe, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(struct.pack("<Q", len(data)) + data)
    pipe.flush()


def _read_message(pipe):
    """A message from our own parent or worker process (the pipe is ours: it carries our objects)."""
    head = pipe.read(8)
    if len(head) < 8:
        return None
    size = struct.unpack("<Q", head)[0]
    data = pipe.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def _receive(proc) -> Encoded | tuple[str, str]:
    message = _read_message(proc.stdout)
    if message is None:
        raise WorkerFailed(f"a worker process ended (exit code {proc.poll()})")
    return message


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def serve(stdin, stdout) -> None:
    """A worker: the tokenizer and settings, then batches, each answered with its Encoded (or (field, message))."""
    init = _read_message(stdin)
    if init is None:
        return
    tokenizer_type, assets, settings = init
    tok = build_tokenizer(tokenizer_type) if tokenizer_type == "byte" else tokenizer_from_assets(tokenizer_type, assets)
    encoder = Encoder(tok, *settings)
    while (batch := _read_message(stdin)) is not None:
        try:
            result: Encoded | tuple[str, str] = encoder.encode(batch)
        except ConfigError as e:
            result = (e.field, e.message)
        _send(stdout, result)


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
