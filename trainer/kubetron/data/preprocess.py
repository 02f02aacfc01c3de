"""``kubetron preprocess``: text -> Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Inputs, by file name (a trailing ``.gz`` is read through gzip):

* ``*.jsonl`` / ``*.json``: one JSON object per line; the document is the string under
  ``json_key`` (default ``"text"``). Blank lines are skipped.
* anything else is plain text: documents are separated by one or more blank lines (a line that is
  empty or only whitespace); newlines inside a document are kept. A file with no blank line is a
  single document.

Each document is byte-tokenized (UTF-8 bytes, see :mod:`kubetron.data.tokenizer`) and, by default,
followed by the ``eod`` token (256); documents with no text are skipped. The output is written with
megatron-core's ``IndexedDatasetBuilder`` (one sequence per document, dtype ``uint16`` - what
``DType.optimal_dtype`` picks for a 258-token vocabulary) to temporary files that are renamed into
place at the end, so a failed run never leaves a half-written dataset under the prefix.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterator

from kubetron import exitcodes
from kubetron.data.tokenizer import ByteTokenizer
from kubetron.errors import ConfigError

JSONL_SUFFIXES = (".jsonl", ".json")


def _is_jsonl(path: str) -> bool:
    return path.removesuffix(".gz").lower().endswith(JSONL_SUFFIXES)


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _jsonl_documents(path: str, json_key: str) -> Iterator[str]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError("--input", f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ConfigError(
                    "--input", f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}"
                )
            if json_key not in obj:
                raise ConfigError(
                    "--input", f"{path}:{lineno}: no {json_key!r} key (keys: {sorted(obj)[:10]})"
                )
            text = obj[json_key]
            if not isinstance(text, str):
                raise ConfigError(
                    "--input", f"{path}:{lineno}: {json_key!r} is a {type(text).__name__}, expected a string"
                )
            yield text


def _text_documents(path: str) -> Iterator[str]:
    with _open_text(path) as f:
        lines: list[str] = []
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
        if lines:
            yield "".join(lines).rstrip("\n")


def iter_documents(path: str, json_key: str = "text") -> Iterator[str]:
    """The documents of one input file (see the module docstring for the formats)."""
    return _jsonl_documents(path, json_key) if _is_jsonl(path) else _text_documents(path)


def preprocess(
    inputs: list[str],
    output_prefix: str,
    append_eod: bool = True,
    json_key: str = "text",
    log_every: int = 10_000,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Tokenize ``inputs`` into ``output_prefix.bin/.idx``; returns counts.

    Returns ``{"files", "documents", "tokens", "skipped_empty", "bin", "idx", "seconds"}``.
    A progress line goes to ``log`` (default: stderr) every ``log_every`` documents and at the end.
    Raises ``ConfigError("--input", ...)`` for a missing/unreadable input or bad JSONL (naming
    ``file:line``) and ``ConfigError("--output-prefix", ...)`` when the output cannot be written.
    """
    if log is None:

        def log(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)

    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        raise ConfigError("--input", "no input files given")
    for path in inputs:
        if not os.path.exists(path):
            raise ConfigError("--input", f"{path}: no such file")
        if not os.path.isfile(path):
            raise ConfigError("--input", f"{path}: not a regular file")
        if not os.access(path, os.R_OK):
            raise ConfigError("--input", f"{path}: not readable")
    if not output_prefix:
        raise ConfigError("--output-prefix", "empty output prefix")
    for suffix in (".bin", ".idx"):
        output_prefix = output_prefix.removesuffix(suffix)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--output-prefix", f"cannot create {out_dir}: {exc.strerror}") from None

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tok = ByteTokenizer()
    dtype = DType.optimal_dtype(tok.vocab_size)
    bin_path, idx_path = output_prefix + ".bin", output_prefix + ".idx"
    tmp_bin, tmp_idx = bin_path + ".tmp", idx_path + ".tmp"
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
    except OSError as exc:
        raise ConfigError("--output-prefix", f"cannot write {tmp_bin}: {exc.strerror}") from None

    docs = tokens = skipped = 0
    t0 = last = time.monotonic()
    done = False
    try:
        for path in inputs:
            try:
                for text in iter_documents(path, json_key):
                    if not text:
                        skipped += 1
                        continue
                    ids = tok.encode_np(text, append_eod=append_eod)
                    builder.add_document(ids, [ids.size])
                    docs += 1
                    tokens += ids.size
                    if log_every and docs % log_every == 0:
                        now = time.monotonic()
                        log(
                            f"preprocess: {docs} documents, {tokens} tokens "
                            f"({log_every / max(now - last, 1e-9):.0f} docs/s, {path})"
                        )
                        last = now
            except (OSError, EOFError, gzip.BadGzipFile) as exc:
                raise ConfigError("--input", f"{path}: cannot read: {exc}") from None
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
        done = True
    finally:
        if not done:
            with contextlib.suppress(OSError):
                builder.data_file.close()
            for p in (tmp_bin, tmp_idx):
                try:
                    os.remove(p)
                except OSError:
                    pass
    seconds = time.monotonic() - t0
    log(
        f"preprocess: done, {docs} documents, {tokens} tokens, {skipped} empty skipped "
        f"in {seconds:.1f}s ({docs / max(seconds, 1e-9):.0f} docs/s) -> {bin_path}, {idx_path}"
    )
    return {
        "files": len(inputs),
        "documents": docs,
        "tokens": tokens,
        "skipped_empty": skipped,
        "bin": bin_path,
        "idx": idx_path,
        "seconds": seconds,
    }


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``kubetron preprocess`` arguments (for the CLI to mount as a subcommand)."""
    parser.add_argument(
        "--input", nargs="+", required=True, metavar="FILE", help=".jsonl/.json or plain text files"
    )
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="JSONL key holding the document text")
    parser.add_argument(
        "--no-append-eod", dest="append_eod", action="store_false", help="no eod after documents"
    )
    parser.add_argument("--log-every", type=int, default=10_000, help="progress line every N documents")
    return parser


def run(args: argparse.Namespace) -> dict:
    """Run from parsed arguments (see :func:`add_arguments`); prints the counts as JSON to stdout."""
    result = preprocess(
        args.input,
        args.output_prefix,
        append_eod=args.append_eod,
        json_key=args.json_key,
        log_every=args.log_every,
    )
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(
        argparse.ArgumentParser(prog="kubetron preprocess", description=__doc__.split("\n")[0])
    )
    args = parser.parse_args(argv)
    try:
        run(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    return exitcodes.COMPLETED


if __name__ == "__main__":
    raise SystemExit(main())
