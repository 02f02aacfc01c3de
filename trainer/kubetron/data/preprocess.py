"""``kubetron preprocess``: text -> Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Inputs, by file name (a trailing ``.gz`` is read through gzip, and may give at most
max(256 MiB, ``--max-expansion`` x its size) once decompressed: a compression bomb is refused in one line):

* ``*.jsonl`` / ``*.json``: one JSON object per line; each document is the string under each of
  ``--json-keys`` (default ``text``). Blank lines are skipped.
* Parquet and Arrow files (``datasets``' ``save_to_disk`` shards), known by their bytes whatever their name:
  each document is a row's string in the column each of ``--json-keys`` names, read with ``pyarrow`` (never
  as text); one that pyarrow cannot read is refused in one line.
* anything else is plain text: documents are separated by one or more blank lines (a line that is
  empty or only whitespace); newlines inside a document are kept. A file with no blank line is a
  single document.

Each document is tokenized with any of the trainer's tokenizers (``--tokenizer-type``, default
``byte``; see :mod:`kubetron.data.tokenizer`) and, by default, followed by the tokenizer's ``eod``;
documents with no text are skipped. With one JSON key the output is ``PREFIX.bin/.idx``; with
several, one dataset per key, ``PREFIX_<key>.bin/.idx`` (Megatron's ``preprocess_data.py`` layout).
The output is written with megatron-core's ``IndexedDatasetBuilder`` (one sequence per document,
``DType.optimal_dtype`` of the vocabulary) to temporary files renamed into place at the end, so a
failed run (a bad line, a missing key, inputs without a single document) leaves nothing under the prefix.
Beside each output, ``PREFIX.tokenizer.json`` records which tokenizer made it
(:func:`kubetron.data.datasets.tokenizer_record`): a run whose tokenizer differs refuses the data at start.

``--workers N`` parses and tokenizes chunks of lines in N processes; the main process reads the
files and writes the output in input order, so the result does not depend on N. Progress
(documents, tokens, tokens/s, ETA from the bytes read) is one ``\\r``-refreshed line on a terminal
and a plain line every ``--log-interval`` seconds otherwise (pod logs).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import itertools
import json
import multiprocessing
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator

from kubetron.contract import exitcodes
from kubetron.contract.errors import ConfigError
from kubetron.data.sft.files import DEFAULT_EXPANSION, Budget, Counted
from kubetron.data.tokenizer import TOKENIZER_TYPES, build_tokenizer, tokenizer_from_assets

JSONL_SUFFIXES = (".jsonl", ".json")
CHUNK_BYTES = 1 << 18  # work unit sent to a worker: about 256 KiB of input text
TABLE_ROWS = 4096  # rows of a Parquet/Arrow file per work unit
# A columnar file by its first bytes: Parquet, the Arrow IPC file, the Arrow IPC stream (datasets' .arrow).
_TABLE_MAGIC = ((b"PAR1", "Parquet"), (b"ARROW1", "Arrow"), (b"\xff\xff\xff\xff", "Arrow stream"))


def _is_jsonl(path: str) -> bool:
    return path.removesuffix(".gz").lower().endswith(JSONL_SUFFIXES)


def table_kind(path: str) -> str | None:
    """"Parquet", "Arrow" or "Arrow stream" for a columnar file (by its first bytes), else None."""
    with open(path, "rb") as f:
        head = f.read(8)
    return next((kind for magic, kind in _TABLE_MAGIC if head.startswith(magic)), None)


def _table_batches(path: str, kind: str, json_keys: tuple[str, ...]) -> Iterator[list[list]]:
    """Per batch of rows, the values of each column in ``json_keys``; a file pyarrow cannot read is one line."""
    import pyarrow

    try:
        yield from _read_table(path, kind, json_keys)
    except (pyarrow.ArrowException, OSError) as e:
        raise ConfigError("--input", f"{path}: cannot read it as {kind} data: {' '.join(str(e).split())[:200]}") \
            from None


def _read_table(path: str, kind: str, json_keys: tuple[str, ...]) -> Iterator[list[list]]:
    import pyarrow.ipc
    import pyarrow.parquet

    if kind == "Parquet":
        pf = pyarrow.parquet.ParquetFile(path)
        _check_columns(path, pf.schema_arrow, json_keys)
        batches = pf.iter_batches(batch_size=TABLE_ROWS, columns=list(json_keys))
    else:
        reader = (pyarrow.ipc.open_file if kind == "Arrow" else pyarrow.ipc.open_stream)(pyarrow.memory_map(path))
        _check_columns(path, reader.schema, json_keys)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if kind == "Arrow" else reader
    for batch in batches:
        yield [batch.column(batch.schema.get_field_index(k)).to_pylist() for k in json_keys]


def _check_columns(path: str, schema, json_keys: tuple[str, ...]) -> None:
    import pyarrow

    for key in json_keys:
        if key not in schema.names:
            raise ConfigError("--json-keys", f"{path}: no column {key!r} (columns: {schema.names[:10]})")
        kind = schema.field(key).type
        if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
            raise ConfigError("--json-keys", f"{path}: column {key!r} is {kind}, expected strings")


class _Input:
    """An input file read as text lines, with the raw byte position (for progress through .gz too); a
    columnar file (``table``) is read by column instead."""

    def __init__(self, path: str, expansion: int = DEFAULT_EXPANSION):
        self.path = path
        self.table = table_kind(path)
        self.raw = open(path, "rb")
        stream = self.raw
        if path.endswith(".gz"):  # what it gives is bounded: a compression bomb is refused, naming the file
            budget = Budget(path, os.fstat(self.raw.fileno()).st_size, expansion, "--input", "--max-expansion")
            stream = io.BufferedReader(Counted(gzip.GzipFile(fileobj=self.raw), budget))
        self.text = io.TextIOWrapper(stream, encoding="utf-8", errors="replace")

    def position(self) -> int:
        return self.raw.tell()

    def close(self) -> None:
        self.text.close()
        self.raw.close()


# ---------------------------------------------------------------------------------------------
# documents


def _parse_jsonl(path: str, first_lineno: int, lines: list[str], json_keys: tuple[str, ...]) -> list[list[str]]:
    """``[[text of key 0 per line], [text of key 1 per line], ...]``; ConfigError naming ``file:line``."""
    out: list[list[str]] = [[] for _ in json_keys]
    for lineno, line in enumerate(lines, start=first_lineno):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError("--input", f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ConfigError("--input", f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        for k, key in enumerate(json_keys):
            if key not in obj:
                raise ConfigError("--json-keys", f"{path}:{lineno}: no {key!r} key (keys: {sorted(obj)[:10]})")
            text = obj[key]
            if not isinstance(text, str):
                raise ConfigError("--json-keys", f"{path}:{lineno}: {key!r} is a {type(text).__name__}, "
                                                 "expected a string")
            out[k].append(text)
    return out


def _text_documents(lines: Iterator[str]) -> Iterator[str]:
    buf: list[str] = []
    for line in lines:
        if line.strip():
            buf.append(line)
        elif buf:
            yield "".join(buf).rstrip("\n")
            buf = []
    if buf:
        yield "".join(buf).rstrip("\n")


def iter_documents(path: str, json_key: str = "text") -> Iterator[str]:
    """The documents of one input file (see the module docstring for the formats)."""
    inp = _Input(path)
    try:
        if not _is_jsonl(path):
            yield from _text_documents(inp.text)
            return
        for lineno, line in enumerate(inp.text, start=1):
            yield from _parse_jsonl(path, lineno, [line], (json_key,))[0]
    finally:
        inp.close()


def _chunks(inp: _Input, json_keys: tuple[str, ...]) -> Iterator[tuple]:
    """Work units of about CHUNK_BYTES: ("jsonl", path, first line number, lines), ("text", path, 0, docs) or
    ("table", path, first row, [values per key])."""
    if inp.table is not None:
        first = 0
        for columns in _table_batches(inp.path, inp.table, json_keys):
            yield ("table", inp.path, first, columns)
            first += len(columns[0])
        return
    jsonl = _is_jsonl(inp.path)
    source = inp.text if jsonl else _text_documents(inp.text)
    first, buf, size, lineno = 1, [], 0, 0
    for lineno, item in enumerate(source, start=1):
        buf.append(item)
        size += len(item)
        if size >= CHUNK_BYTES:
            yield ("jsonl" if jsonl else "text", inp.path, first, buf)
            first, buf, size = lineno + 1, [], 0
    if buf:
        yield ("jsonl" if jsonl else "text", inp.path, first, buf)


# ---------------------------------------------------------------------------------------------
# tokenizing (in the main process or in workers)

_WORKER: dict = {}


def _init_worker(tokenizer_type: str, assets: dict[str, bytes], json_keys, append_eod: bool,
                 pool: bool = True) -> None:
    if pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; no threads per worker
    tok = build_tokenizer("byte") if tokenizer_type == "byte" else tokenizer_from_assets(tokenizer_type, assets)
    _WORKER.update(tok=tok, json_keys=tuple(json_keys), append_eod=append_eod)


def _encode_chunk(chunk: tuple) -> tuple:
    """One work unit -> (per key: (ids, lengths), documents, empty skipped) or ("error", field, message)."""
    kind, path, first, items = chunk
    tok, keys, eod = _WORKER["tok"], _WORKER["json_keys"], _WORKER["append_eod"]
    try:
        columns = _parse_jsonl(path, first, items, keys) if kind == "jsonl" else items if kind == "table" \
            else [items]
    except ConfigError as exc:
        return ("error", exc.field, exc.message)
    out, skipped = [], 0
    for texts in columns:
        kept = [t for t in texts if t]  # a table's null is an empty document
        skipped += len(texts) - len(kept)
        out.append(_encode_texts(tok, kept, eod))
    return (out, sum(len(c) for c in columns), skipped)


def _encode_texts(tok, texts: list[str], append_eod: bool):
    """(ids int32, lengths int64) of ``texts``, each followed by eod if asked."""
    import numpy as np

    if tok.tokenizer_type == "byte":  # no lists of ints: bytes straight into the array
        arrays = [tok.encode_np(t, append_eod) for t in texts]
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        ids = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
        return ids, lengths
    encoded = tok.encode_batch(texts) if texts else []
    if append_eod:
        for ids in encoded:
            ids.append(tok.eod)
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=int(lengths.sum()))
    return ids, lengths


# ---------------------------------------------------------------------------------------------
# progress


class Progress:
    """Documents, tokens, tokens/s and ETA: a ``\\r`` line on a terminal, plain lines every ``interval`` s."""

    def __init__(self, total_bytes: int, log: Callable[[str], None] | None, interval: float, tty: bool):
        self.total_bytes, self.interval, self.tty = max(1, total_bytes), interval, tty
        self.log = log
        self.t0 = self.last = time.monotonic()

    def line(self, docs: int, tokens: int, done_bytes: int) -> str:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        frac = min(1.0, done_bytes / self.total_bytes)
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
        eta_s = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        return (f"preprocess: {docs:,} documents, {tokens:,} tokens, {tokens / elapsed:,.0f} tokens/s, "
                f"{100 * frac:.0f}% read, ETA {eta_s}")

    def update(self, docs: int, tokens: int, done_bytes: int) -> None:
        now = time.monotonic()
        if now - self.last < (min(0.2, self.interval) if self.tty else self.interval):
            return
        self.last = now
        if self.tty:
            print("\r" + self.line(docs, tokens, done_bytes), end="", file=sys.stderr, flush=True)
        elif self.log is not None:
            self.log(self.line(docs, tokens, done_bytes))

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the run


def _check_inputs(inputs: list[str]) -> None:
    if not inputs:
        raise ConfigError("--input", "no input files given")
    for path in inputs:
        if not os.path.exists(path):
            raise ConfigError("--input", f"{path}: no such file")
        if not os.path.isfile(path):
            raise ConfigError("--input", f"{path}: not a regular file")
        if not os.access(path, os.R_OK):
            raise ConfigError("--input", f"{path}: not readable")


def _output_prefixes(output_prefix: str, json_keys: tuple[str, ...]) -> list[str]:
    if not output_prefix:
        raise ConfigError("--output-prefix", "empty output prefix")
    for suffix in (".bin", ".idx"):
        output_prefix = output_prefix.removesuffix(suffix)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--output-prefix", f"cannot create {out_dir}: {exc.strerror}") from None
    return [output_prefix] if len(json_keys) == 1 else [f"{output_prefix}_{k}" for k in json_keys]


class _Outputs:
    """One IndexedDatasetBuilder per JSON key, on temporary files renamed into place by commit(), each with the
    record of the tokenizer that made it (``record``, written as PREFIX.tokenizer.json)."""

    def __init__(self, prefixes: list[str], tokenizer):
        from kubetron.data.datasets import TOKENIZER_RECORD, tokenizer_record  # numpy: not at the CLI's import

        self.record, self.record_suffix = tokenizer_record(tokenizer), TOKENIZER_RECORD
        vocab_size = tokenizer.vocab_size
        with warnings.catch_warnings():  # megatron-core's import notes (no TransformerEngine...) are noise here
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        self.prefixes, self.builders = prefixes, []
        dtype = DType.optimal_dtype(vocab_size)
        for prefix in prefixes:
            try:
                self.builders.append(IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=dtype))
            except OSError as exc:
                self.abort()
                raise ConfigError("--output-prefix", f"cannot write {prefix}.bin.tmp: {exc.strerror}") from None

    def add(self, columns) -> None:
        for builder, (ids, lengths) in zip(self.builders, columns):
            start = 0
            for n in lengths.tolist():
                builder.add_document(ids[start : start + n], [n])
                start += n

    def commit(self) -> None:
        for builder, prefix in zip(self.builders, self.prefixes):
            builder.finalize(prefix + ".idx.tmp")
            with open(prefix + self.record_suffix + ".tmp", "w", encoding="utf-8") as f:
                json.dump(self.record, f)
        for prefix in self.prefixes:
            os.replace(prefix + ".bin.tmp", prefix + ".bin")
            os.replace(prefix + ".idx.tmp", prefix + ".idx")
            os.replace(prefix + self.record_suffix + ".tmp", prefix + self.record_suffix)

    def abort(self) -> None:
        for builder in self.builders:
            with contextlib.suppress(OSError):
                builder.data_file.close()
        for prefix in self.prefixes:
            for p in (prefix + ".bin.tmp", prefix + ".idx.tmp", prefix + self.record_suffix + ".tmp"):
                with contextlib.suppress(OSError):
                    os.remove(p)


InitArgs = tuple[str, dict[str, bytes], tuple[str, ...], bool]
"""_init_worker's arguments: tokenizer type, its files, the JSON keys, append_eod."""


def _results(chunks: Iterator[tuple], workers: int, init_args: InitArgs):
    """Encoded chunks in input order: in this process, or from a pool of ``workers`` processes."""
    if workers <= 1:
        _init_worker(*init_args, pool=False)  # tokenizers' own batch encoder may use its threads
        yield from map(_encode_chunk, chunks)
        return
    # fork is cheapest, but forking a process that runs other threads (a caller's HTTP server, an
    # SDK's monitor thread) can leave a worker holding a lock forever: spawn then (light imports).
    single_threaded = threading.active_count() == 1
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" and single_threaded else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        yield from pool.imap(_encode_chunk, chunks, chunksize=1)


def preprocess(
    inputs: list[str] | str,
    output_prefix: str,
    tokenizer=None,
    append_eod: bool = True,
    json_keys: str | list[str] | tuple[str, ...] = ("text",),
    workers: int = 1,
    log: Callable[[str], None] | None = None,
    log_interval: float = 10.0,
    tty: bool | None = None,
    max_expansion: int = DEFAULT_EXPANSION,
) -> dict:
    """Tokenize ``inputs`` into ``output_prefix.bin/.idx`` (one dataset per JSON key); returns counts.

    ``tokenizer`` is any :mod:`kubetron.data.tokenizer` tokenizer (default: byte). Returns
    ``{"files", "documents", "tokens", "skipped_empty", "outputs", "seconds", "tokens_per_second"}``.
    Raises ``ConfigError`` naming the flag (``--input``, ``--json-keys``, ``--output-prefix``) and
    ``file:line`` for bad input; nothing is left under the prefix then.
    """
    if log is None:

        def log(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)

    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    json_keys = (json_keys,) if isinstance(json_keys, str) else tuple(json_keys)
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise ConfigError("--json-keys", f"need distinct keys, got {list(json_keys)}")
    if workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {workers}")
    if max_expansion < 1:
        raise ConfigError("--max-expansion", f"must be >= 1, got {max_expansion}")
    _check_inputs(inputs)
    tok = tokenizer or build_tokenizer("byte")
    prefixes = _output_prefixes(output_prefix, json_keys)
    init_args = (tok.tokenizer_type, tok.assets(), json_keys, append_eod)
    outputs = _Outputs(prefixes, tok)  # imports megatron-core: before the clock starts
    progress = Progress(sum(os.path.getsize(p) for p in inputs), log, log_interval,
                        sys.stderr.isatty() if tty is None else tty)
    docs = tokens = skipped = done_bytes = 0
    committed = False
    try:
        for path in inputs:
            inp = _Input(path, max_expansion)
            try:
                for result in _results(_chunks(inp, json_keys), workers, init_args):
                    if result[0] == "error":
                        raise ConfigError(result[1], result[2])
                    columns, n_docs, n_skipped = result
                    outputs.add(columns)
                    docs += n_docs - n_skipped
                    skipped += n_skipped
                    tokens += sum(int(ids.size) for ids, _ in columns)
                    progress.update(docs, tokens, done_bytes + inp.position())
            except (OSError, EOFError, gzip.BadGzipFile) as exc:
                raise ConfigError("--input", f"{path}: cannot read: {exc}") from None
            finally:
                done_bytes += os.path.getsize(path)
                inp.close()
        if docs == 0:
            raise ConfigError("--input", f"{', '.join(inputs[:3])}: no documents (only blank lines or empty texts"
                                         f"{'' if skipped == 0 else f', {skipped} empty skipped'})")
        outputs.commit()
        committed = True
    finally:
        progress.close()
        if not committed:
            outputs.abort()
    seconds = time.monotonic() - progress.t0
    log(f"preprocess: done, {docs} documents, {tokens} tokens, {skipped} empty skipped in {seconds:.1f}s "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s, {workers} worker(s), tokenizer {tok.tokenizer_type} of "
        f"{tok.vocab_size} ids) -> " + ", ".join(p + ".bin/.idx" for p in prefixes))
    return {
        "files": len(inputs),
        "documents": docs,
        "tokens": tokens,
        "skipped_empty": skipped,
        "outputs": prefixes,
        "seconds": seconds,
        "tokens_per_second": tokens / max(seconds, 1e-9),
    }


# ---------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``kubetron preprocess`` arguments (Megatron's ``preprocess_data.py`` names)."""
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help=".jsonl/.json or plain text files (optionally .gz), Parquet or Arrow files")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-keys", "--json-key", nargs="+", default=["text"], metavar="KEY",
                        help="JSONL keys (Parquet/Arrow columns) holding document text; several keys write "
                             "PREFIX_<key>.bin/.idx each (default: text)")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="end every document with the tokenizer's eod token (default: on)")
    parser.add_argument("--tokenizer-type", default="byte", choices=TOKENIZER_TYPES[:1] + TOKENIZER_TYPES[2:],
                        help="as tokenizer.tokenizer_type (default: byte)")
    parser.add_argument("--tokenizer-model", default=None, metavar="PATH",
                        help="HuggingFaceTokenizer: tokenizer.json or its directory; SentencePieceTokenizer: .model")
    parser.add_argument("--vocab-file", default=None, metavar="PATH", help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", default=None, metavar="PATH", help="GPT2BPETokenizer: merges.txt")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes (default: 1)")
    parser.add_argument("--log-interval", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between progress lines when stderr is not a terminal (default: 10)")
    parser.add_argument("--max-expansion", type=int, default=DEFAULT_EXPANSION, metavar="N",
                        help="a .gz input may give at most max(256 MiB, N x its size) once decompressed; more is "
                             f"refused as a compression bomb (default: {DEFAULT_EXPANSION})")
    return parser


def _tokenizer_from_args(args: argparse.Namespace):
    from kubetron.contract.config import TokenizerConfig

    section = TokenizerConfig(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                              vocab_file=args.vocab_file, merge_file=args.merge_file)
    try:
        section.validate_fields()
        return build_tokenizer(section)
    except ConfigError as exc:  # name the flag the user typed, not the config key
        flag = "--" + exc.field.removeprefix("tokenizer.").replace("_", "-")
        raise ConfigError(flag, exc.message) from None


def run(args: argparse.Namespace) -> dict:
    """Run from parsed arguments (see :func:`add_arguments`); prints the counts as JSON to stdout."""
    _check_inputs(args.input)
    result = preprocess(args.input, args.output_prefix, tokenizer=_tokenizer_from_args(args),
                        append_eod=args.append_eod, json_keys=args.json_keys, workers=args.workers,
                        log_interval=args.log_interval, max_expansion=args.max_expansion)
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="kubetron preprocess", description=__doc__.split("\n")[0]))
    args = parser.parse_args(argv)
    try:
        run(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    return exitcodes.COMPLETED


if __name__ == "__main__":
    raise SystemExit(main())
