"""Where fine-tuning rows come from: files, directories, globs and lists of them, local or ``s3://``.

``finetuning.data_path`` is a path or a list of paths, read in order; each may be

* a file: JSON Lines (``.jsonl``, ``.ndjson``, or ``.json`` with one object per line), a JSON array of objects (a
  ``.json`` file whose text starts with ``[``), CSV or TSV (``.csv``/``.tsv``: a header row, quoted fields may hold
  newlines; an empty field is null, as ``datasets`` reads it), each also gzip- or zstd-compressed (``.gz``/``.zst``),
  Parquet, or Arrow (an IPC file or stream, as ``datasets`` writes ``data-*.arrow``). Compression, Parquet and Arrow
  are told by the file's first bytes, not its name;
* a directory written by ``datasets``' ``save_to_disk`` (its ``state.json`` lists the Arrow files, in order); a
  ``DatasetDict`` (``dataset_dict.json``) gives the split of the field: ``train`` for ``data_path``; ``validation``,
  ``valid`` or ``test`` for ``valid_data_path`` (or name one: ``DIR/SPLIT``);
* any other directory: the data files under it (``.jsonl``, ``.json``, ``.ndjson``, ``.csv``, ``.tsv``, ``.gz``/``.zst``
  of those, ``.parquet``, ``.arrow``), sorted by path;
* a glob (``data/train-*.parquet``, ``**`` for any depth); ``datasets``' metadata files it matches
  (``dataset_dict.json``, ``state.json``, ``dataset_info.json``) are not data.

``s3://bucket/key`` paths work the same (endpoint and credentials from the ``AWS_*`` environment, as for
pretraining data and stores); an object is read whole into memory.

Bounds (data files are hostile input: another job, or anyone who can write the data volume, may have made them):
a file inside a data directory or matched by a glob is read only when it is a regular file there (a symbolic link is
refused, naming it: a link could lead anywhere); one file gives at most ``max(256 MiB, finetuning.max_expansion x its
stored size)`` bytes of rows once decompressed or decoded, and as many rows (a Parquet file's own metadata is checked
before a row is decoded), so a small compressed file cannot fill memory (one line naming it).
"""

from __future__ import annotations

import csv
import fnmatch
import functools
import glob
import gzip
import io
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kubetron.contract.errors import ConfigError
from kubetron.data.sft.rows import TableRow

log = logging.getLogger("kubetron")

DATA_SUFFIXES = (".jsonl", ".json", ".ndjson", ".csv", ".tsv", ".parquet", ".arrow")
DATASETS_METADATA = ("dataset_dict.json", "state.json", "dataset_info.json")
VALID_SPLITS = ("validation", "valid", "test")
_COMPRESSED = (".gz", ".zst")
_GLOB_CHARS = "*?["
_TABLE_BATCH = 4096
_FIRST_BATCH = 64  # rows decoded before the batch size is set from their size
_BATCH_BYTES = 16 << 20  # decoded bytes a batch of a table aims at
MIN_BUDGET = 256 << 20  # bytes (and rows) any one file may give, whatever its stored size
DEFAULT_EXPANSION = 100
csv.field_size_limit(MIN_BUDGET)  # csv's default (128 KiB) refuses long chats; a file's budget still bounds it


@dataclass(frozen=True)
class DataFile:
    """One input file: `url` names it in messages; `store` is its s3:// bucket (None: a local path `key`)."""

    url: str
    key: str
    size: int
    version: str
    store: str | None = None
    listed: bool = False  # found in a directory or by a glob: opened without following a link

    def identity(self) -> list:
        return [self.url, self.size, self.version]

    def open(self):
        if self.store is None:
            flags = os.O_RDONLY | (os.O_NOFOLLOW if self.listed else 0)
            try:
                fd = os.open(self.key, flags)
            except OSError as e:
                if self.listed and os.path.islink(self.key):
                    raise OSError(f"{self.key} became a symbolic link") from None
                raise e
            return os.fdopen(fd, "rb")
        return _bucket(self.store).open_read(self.key)


@functools.lru_cache(maxsize=8)
def _bucket(url: str):
    """One store (one S3 client) per bucket for all its files."""
    from kubetron.storage import open_store

    return open_store(url)


def resolve(paths: str | list[str], field: str) -> list[DataFile]:
    """The files `paths` names, in reading order (no data is read: a stat or a HEAD per file)."""
    out = []
    for path in [paths] if isinstance(paths, str) else list(paths):
        try:
            out += _s3_files(path, field) if path.startswith("s3://") else _local_files(path, field)
        except OSError as e:  # an S3 failure (CheckpointError) is not the config's: it goes on as the error it is
            raise ConfigError(field, f"{path}: cannot read ({e})") from None
    return out


def _is_data_name(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    if base.startswith("."):
        return False
    for suffix in _COMPRESSED:
        base = base.removesuffix(suffix)
    return base.endswith(DATA_SUFFIXES)


def _local_file(path: str, listed: bool = False) -> DataFile:
    st = os.stat(path, follow_symlinks=not listed)
    return DataFile(path, path, st.st_size, str(st.st_mtime_ns), listed=listed)


def _local_files(path: str, field: str) -> list[DataFile]:
    if any(c in path for c in _GLOB_CHARS):
        matches = [m for m in sorted(glob.glob(path, recursive=True))
                   if os.path.basename(m) not in DATASETS_METADATA]
        if not matches:
            raise ConfigError(field, f"{path}: matches no file")
        out = []
        for m in matches:
            _no_link(m, path, field)
            out += _local_dir(m, field) if os.path.isdir(m) else [_local_file(m, listed=True)]
        return out
    if os.path.isdir(path):
        return _local_dir(path, field)
    if not os.path.exists(path):
        raise ConfigError(field, f"{path}: no such file or directory")
    return [_local_file(path)]


def _no_link(path: str, named: str, field: str) -> None:
    """A file found in a data directory or by a glob must be a regular file or directory there, not a link."""
    if os.path.islink(path):
        raise ConfigError(field, f"{path}: a symbolic link (to {os.readlink(path)}) in the data {named}; kubetron "
                                 "follows no link it finds there (it could lead anywhere): name the file itself in "
                                 "finetuning.data_path, or copy it in")


def _local_dir(path: str, field: str) -> list[DataFile]:
    def read(name: str) -> bytes | None:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return None
        with DataFile(full, full, 0, "", listed=True).open() as f:
            return f.read(1 << 20)

    names = []
    for parent, dirs, files in os.walk(path):
        rel = os.path.relpath(parent, path)
        if any(part.startswith(".") for part in rel.split(os.sep) if part != "."):
            continue
        for n in dirs + files:
            if not n.startswith("."):
                _no_link(os.path.join(parent, n), f"directory {path}", field)
        names += [os.path.normpath(os.path.join(rel, n)).replace(os.sep, "/") for n in files]
    chosen = _dir_data_names(path, sorted(names), read, field)
    return [_local_file(os.path.join(path, n), listed=True) for n in chosen]


def _dir_data_names(path: str, names: list[str], read: Callable[[str], bytes | None], field: str) -> list[str]:
    """The data files of a directory listing: the Arrow files a `save_to_disk` state.json lists, else every
    file with a data suffix. A DatasetDict (dataset_dict.json): the field's split (train, or validation)."""
    if "dataset_dict.json" in names:
        split = _split_of(path, read, field)
        inner = [n[len(split) + 1:] for n in names if n.startswith(split + "/")]
        sub = f"{path.rstrip('/')}/{split}"
        return [f"{split}/{n}" for n in _dir_data_names(sub, inner, lambda n: read(f"{split}/{n}"), field)]
    if "state.json" in names:
        state = _json(read("state.json"), f"{path}/state.json", field)
        files: list[Any] = [d.get("filename") for d in state.get("_data_files") or [] if isinstance(d, dict)]
        if not files or not all(isinstance(f, str) and f in names for f in files):
            raise ConfigError(field, f"{path}/state.json: lists no Arrow files of this directory")
        return files
    chosen = [n for n in names if _is_data_name(n)]
    if not chosen:
        raise ConfigError(field, f"{path}: no data files in it (.jsonl, .json, .ndjson, .parquet, .arrow, "
                                 "optionally .gz/.zst)")
    return chosen


def _split_of(path: str, read: Callable[[str], bytes | None], field: str) -> str:
    """The split of a DatasetDict the field reads: train for data_path, validation (or valid, test) for
    valid_data_path; refused naming the splits when it has none of them."""
    splits = [str(s) for s in _json(read("dataset_dict.json"), f"{path}/dataset_dict.json", field).get("splits") or []]
    wanted = VALID_SPLITS if field.endswith("valid_data_path") else ("train",)
    found = next((s for s in wanted if s in splits), None)
    if found is None:
        raise ConfigError(field, f"{path}: a datasets DatasetDict with splits {', '.join(splits)} and none named "
                                 f"{' or '.join(wanted)}; give one split's directory (e.g. {path.rstrip('/')}/"
                                 f"{splits[0] if splits else 'SPLIT'})")
    log.info("%s: reading split %r of the DatasetDict (splits: %s)", path, found, ", ".join(splits))
    return found


def _json(data: bytes | None, where: str, field: str) -> dict:
    try:
        value = json.loads(data or b"")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(field, f"{where}: not a JSON object")
    return value


def _s3_files(url: str, field: str) -> list[DataFile]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    root = f"s3://{bucket}"
    store = _bucket(root)
    key = key.rstrip("/")

    def file(k: str) -> DataFile:
        size, etag = store.stat(k)
        return DataFile(f"{root}/{k}", k, size, etag, root)

    if any(c in key for c in _GLOB_CHARS):
        fixed = key[:min(key.find(c) for c in _GLOB_CHARS if c in key)].rpartition("/")[0]
        matches = [k for k in store.list(fixed) if fnmatch.fnmatchcase(k, key)
                   and k.rpartition("/")[2] not in DATASETS_METADATA]
        if not matches:
            raise ConfigError(field, f"{url}: matches no object")
        return [file(k) for k in matches]
    if key and store.exists(key):
        return [file(key)]
    names = [k[len(key) + 1:] if key else k for k in store.list(key)]
    if not names:
        raise ConfigError(field, f"{url}: no such object or prefix")

    def read(name: str) -> bytes | None:
        full = f"{key}/{name}" if key else name
        return store.read_bytes(full) if name in names else None

    return [file(f"{key}/{n}" if key else n) for n in _dir_data_names(url, names, read, field)]


# ---------------------------------------------------------------------------------------------------------
# reading rows


def read_rows(files: list[DataFile], field: str, progress: Callable[[int], None] | None = None,
              expansion: int = DEFAULT_EXPANSION) -> Iterator[tuple[str, object]]:
    """(where, row) of every row, in order; `where` is ``FILE:LINE`` (JSON Lines), ``FILE row N`` (tables, CSV) or
    ``FILE item N`` (a JSON array). `progress(bytes)` is called with the bytes of finished files."""
    done = 0
    for f in files:
        budget = Budget(f.url, f.size, expansion, field)
        try:
            with f.open() as raw:
                yield from _rows_of(f.url, raw, field, budget)
        except (OSError, EOFError) as e:
            raise ConfigError(field, f"{f.url}: cannot read ({e})") from None
        done += f.size
        if progress:
            progress(done)


class Budget:
    """What one file may give: max(MIN_BUDGET, expansion x its stored size) bytes of rows, and as many rows."""

    def __init__(self, url: str, stored: int, expansion: int, field: str):
        self.url, self.stored, self.expansion, self.field = url, stored, expansion, field
        self.limit = max(MIN_BUDGET, expansion * stored)
        self.bytes = self.rows = 0

    def take(self, nbytes: int = 0, rows: int = 0) -> None:
        self.bytes += nbytes
        self.rows += rows
        if self.bytes > self.limit or self.rows > self.limit:
            what = f"{self.rows} rows" if self.rows > self.limit else f"{self.bytes} bytes"
            raise self.error(what)

    def error(self, what: str) -> ConfigError:
        return ConfigError(self.field, f"{self.url}: gives more than {what} once decompressed, over the bound of "
                                       f"{self.limit} (max(256 MiB, {self.expansion} x its {self.stored} stored bytes;"
                                       " finetuning.max_expansion)): a compression bomb, or a file to split")


class _Counted(io.RawIOBase):
    """A decompressed stream whose bytes are taken from a Budget as they are read."""

    def __init__(self, inner, budget: Budget):
        self.inner, self.budget = inner, budget

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.inner.readinto(b)
        self.budget.take(n or 0)
        return n


def _rows_of(url: str, raw, field: str, budget: Budget) -> Iterator[tuple[str, object]]:
    head = raw.read(8)
    raw.seek(0)
    if head.startswith(b"PAR1"):
        yield from _table_rows(url, raw, "parquet", field, budget)
    elif head.startswith(b"ARROW1"):
        yield from _table_rows(url, raw, "arrow-file", field, budget)
    elif head.startswith(b"\xff\xff\xff\xff"):
        yield from _table_rows(url, raw, "arrow-stream", field, budget)
    elif head.startswith(b"\x1f\x8b"):
        yield from _text_rows(url, io.BufferedReader(_Counted(gzip.GzipFile(fileobj=raw), budget)), field, budget)
    elif head.startswith(b"\x28\xb5\x2f\xfd"):
        import zstandard

        stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        yield from _text_rows(url, io.BufferedReader(_Counted(stream, budget)), field, budget)
    else:
        yield from _text_rows(url, io.BufferedReader(_Counted(raw, budget)), field, budget)


def _text_rows(url: str, stream: io.BufferedReader, field: str, budget: Budget) -> Iterator[tuple[str, object]]:
    """CSV/TSV by name, a JSON array by its first character, else JSON Lines."""
    name = url
    for suffix in _COMPRESSED:
        name = name.removesuffix(suffix)
    if name.endswith((".csv", ".tsv")):
        yield from _csv_rows(url, stream, "\t" if name.endswith(".tsv") else ",", field, budget)
        return
    start = stream.peek(64)[:64].lstrip()
    if start.startswith(b"["):
        yield from _json_array(url, stream, field, budget)
    else:
        yield from _json_lines(url, stream, field, budget)


def _lines(stream, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a byte stream (a line of any length in linear time: io's readline is not, on one that long)."""
    buf = bytearray()
    while data := stream.read(chunk):
        start = len(buf)
        buf += data
        cut = buf.rfind(b"\n", start)
        if cut < 0:
            continue
        yield from bytes(buf[:cut + 1]).splitlines(keepends=True)
        del buf[:cut + 1]
    if buf:
        yield bytes(buf)


def _json_lines(url: str, stream, field: str, budget: Budget) -> Iterator[tuple[str, object]]:
    for lineno, line in enumerate(_lines(stream), 1):
        if not line.strip():
            continue
        where = f"{url}:{lineno}"
        budget.take(rows=1)
        try:
            yield where, json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(field, f"{where}: not UTF-8 text (a binary file of another kind?)") from None
        except ValueError as e:
            raise ConfigError(field, f"{where}: not a JSON object ({getattr(e, 'msg', e)}; a file is JSON Lines, "
                                     "or one JSON array of objects)") from None


def _json_array(url: str, stream, field: str, budget: Budget) -> Iterator[tuple[str, object]]:
    """A JSON array of objects (what `json.dump(rows)` and pandas' to_json(orient='records') write)."""
    try:
        rows = json.loads(stream.read().decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(field, f"{url}: not UTF-8 text (a binary file of another kind?)") from None
    except ValueError as e:
        raise ConfigError(field, f"{url}: not a JSON array ({getattr(e, 'msg', e)} at line "
                                 f"{getattr(e, 'lineno', '?')}, column {getattr(e, 'colno', '?')})") from None
    if not isinstance(rows, list):
        raise ConfigError(field, f"{url}: not a JSON array")
    budget.take(rows=len(rows))
    for n, row in enumerate(rows, 1):
        yield f"{url} item {n}", row


def _csv_rows(url: str, stream, delimiter: str, field: str, budget: Budget) -> Iterator[tuple[str, object]]:
    """A header row, then rows (quoted fields may hold newlines); an empty field is null, as datasets reads it."""
    text = io.TextIOWrapper(stream, encoding="utf-8", newline="")
    n = 0
    try:
        for n, row in enumerate(csv.DictReader(text, delimiter=delimiter), 1):
            budget.take(rows=1)
            if None in row:
                raise ConfigError(field, f"{url} row {n}: more fields than the header has")
            yield f"{url} row {n}", {k: (v if v != "" else None) for k, v in row.items()}
    except UnicodeDecodeError:
        raise ConfigError(field, f"{url}: not UTF-8 text (a binary file of another kind?)") from None
    except csv.Error as e:
        raise ConfigError(field, f"{url} row {n + 1}: not CSV ({e})") from None


def _table_rows(url: str, raw, kind: str, field: str, budget: Budget) -> Iterator[tuple[str, object]]:
    import pyarrow as pa

    try:
        n = 0
        for batch in _batches(raw, kind, budget):
            batch = _decoded(batch)
            budget.take(batch.nbytes, batch.num_rows)
            for row in batch.to_pylist():
                n += 1
                yield f"{url} row {n}", TableRow(row)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(field, f"{url}: not a readable {kind.split('-')[0]} file ({e})") from None


def _decoded(batch):
    """The batch with its dictionary-encoded columns decoded: what its rows are once they are Python values (a
    dictionary holds a value once however many rows repeat it: counted as stored, it would hide a bomb)."""
    import pyarrow as pa

    if not any(pa.types.is_dictionary(t) for t in batch.schema.types):
        return batch
    columns = [c.dictionary_decode() if pa.types.is_dictionary(c.type) else c for c in batch.columns]
    return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)


def _batches(raw, kind: str, budget: Budget):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        f = pq.ParquetFile(raw)
        meta = f.metadata  # the rows and the decompressed pages it declares, before any is decoded
        budget.take(rows=meta.num_rows)
        budget.take(sum(meta.row_group(g).column(c).total_uncompressed_size
                        for g in range(meta.num_row_groups) for c in range(meta.num_columns)))
        budget.bytes = budget.rows = 0
        yield from _sized(lambda size: f.iter_batches(batch_size=size))
    elif kind == "arrow-file":
        reader = pa.ipc.open_file(raw)
        yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        yield from iter(pa.ipc.open_stream(raw))


def _sized(batches_of: Callable[[int], Iterator]):
    """A Parquet file's batches: a small first one, then as many rows as make about _BATCH_BYTES decoded (a row
    that decodes large - a dictionary value repeated - never comes thousands at a time)."""
    first = next(iter(batches_of(_FIRST_BATCH)), None)
    if first is None:
        return
    yield first
    per_row = max(_decoded(first).nbytes // max(first.num_rows, 1), 1)
    size = max(1, min(_TABLE_BATCH, _BATCH_BYTES // per_row))
    for n, batch in enumerate(batches_of(size)):
        if n * size >= first.num_rows:
            yield batch
        elif (n + 1) * size > first.num_rows:
            yield batch.slice(first.num_rows - n * size)
