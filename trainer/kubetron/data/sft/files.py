"""Where fine-tuning rows come from: files, directories, globs and lists of them, local or ``s3://``.

``finetuning.data_path`` is a path or a list of paths, read in order; each may be

* a file: JSON Lines (``.jsonl``; also gzip- or zstd-compressed, ``.jsonl.gz`` / ``.jsonl.zst``), Parquet, or Arrow
  (an IPC file or stream, as ``datasets`` writes ``data-*.arrow``). The kind is told by the file's first bytes,
  not its name;
* a directory written by ``datasets``' ``save_to_disk`` (its ``state.json`` lists the Arrow files, in order; a
  ``DatasetDict`` is refused with the names of its splits: give one, e.g. ``DIR/train``);
* any other directory: the data files under it (``.jsonl``, ``.json``, ``.ndjson``, ``.gz``/``.zst`` of those,
  ``.parquet``, ``.arrow``), sorted by path;
* a glob (``data/train-*.parquet``, ``**`` for any depth).

``s3://bucket/key`` paths work the same (endpoint and credentials from the ``AWS_*`` environment, as for
pretraining data and stores); an object is read whole into memory. A file is identified by its path, size and
version (mtime, or the ETag on S3): the cache of tokenized data is rebuilt when any of them changes.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kubetron.contract.errors import ConfigError

DATA_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".arrow")
_COMPRESSED = (".gz", ".zst")
_GLOB_CHARS = "*?["
_TABLE_BATCH = 4096


@dataclass(frozen=True)
class DataFile:
    """One input file: `url` names it in messages; `store` is its s3:// bucket (None: a local path `key`)."""

    url: str
    key: str
    size: int
    version: str
    store: str | None = None

    def identity(self) -> list:
        return [self.url, self.size, self.version]

    def open(self):
        if self.store is None:
            return open(self.key, "rb")
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


def _local_file(path: str) -> DataFile:
    st = os.stat(path)
    return DataFile(path, path, st.st_size, str(st.st_mtime_ns))


def _local_files(path: str, field: str) -> list[DataFile]:
    if any(c in path for c in _GLOB_CHARS):
        matches = sorted(glob.glob(path, recursive=True))
        if not matches:
            raise ConfigError(field, f"{path}: matches no file")
        return [f for m in matches for f in (_local_dir(m, field) if os.path.isdir(m) else [_local_file(m)])]
    if os.path.isdir(path):
        return _local_dir(path, field)
    if not os.path.exists(path):
        raise ConfigError(field, f"{path}: no such file or directory")
    return [_local_file(path)]


def _local_dir(path: str, field: str) -> list[DataFile]:
    def read(name: str) -> bytes | None:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return None
        with open(full, "rb") as f:
            return f.read()

    names = sorted(os.path.relpath(os.path.join(parent, n), path).replace(os.sep, "/")
                   for parent, dirs, files in os.walk(path) for n in files
                   if not any(part.startswith(".") for part in os.path.relpath(parent, path).split(os.sep)
                              if part != "."))
    chosen = _dir_data_names(path, names, read, field)
    return [_local_file(os.path.join(path, n)) for n in chosen]


def _dir_data_names(path: str, names: list[str], read: Callable[[str], bytes | None], field: str) -> list[str]:
    """The data files of a directory listing: the Arrow files a `save_to_disk` state.json lists, else every
    file with a data suffix. A DatasetDict (dataset_dict.json) is refused, naming its splits."""
    if "dataset_dict.json" in names:
        splits = _json(read("dataset_dict.json"), f"{path}/dataset_dict.json", field).get("splits") or []
        example = f"{path.rstrip('/')}/{splits[0]}" if splits else f"{path}/SPLIT"
        raise ConfigError(field, f"{path}: a datasets DatasetDict with splits {', '.join(map(str, splits))}; give "
                                 f"one split's directory (e.g. {example})")
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
        matches = [k for k in store.list(fixed) if fnmatch.fnmatchcase(k, key)]
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


def read_rows(files: list[DataFile], field: str, progress: Callable[[int], None] | None = None) -> Iterator[
        tuple[str, object]]:
    """(where, row) of every row, in order; `where` is ``FILE:LINE`` (JSON Lines) or ``FILE row N`` (tables).
    `progress(bytes)` is called with the bytes of finished files."""
    done = 0
    for f in files:
        try:
            with f.open() as raw:
                yield from _rows_of(f.url, raw, field)
        except (OSError, EOFError) as e:
            raise ConfigError(field, f"{f.url}: cannot read ({e})") from None
        done += f.size
        if progress:
            progress(done)


def _rows_of(url: str, raw, field: str) -> Iterator[tuple[str, object]]:
    head = raw.read(8)
    raw.seek(0)
    if head.startswith(b"PAR1"):
        yield from _table_rows(url, raw, "parquet", field)
    elif head.startswith(b"ARROW1"):
        yield from _table_rows(url, raw, "arrow-file", field)
    elif head.startswith(b"\xff\xff\xff\xff"):
        yield from _table_rows(url, raw, "arrow-stream", field)
    elif head.startswith(b"\x1f\x8b"):
        yield from _json_lines(url, gzip.GzipFile(fileobj=raw), field)
    elif head.startswith(b"\x28\xb5\x2f\xfd"):
        import zstandard

        stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        yield from _json_lines(url, io.BufferedReader(stream), field)
    else:
        yield from _json_lines(url, raw, field)


def _json_lines(url: str, stream, field: str) -> Iterator[tuple[str, object]]:
    for lineno, line in enumerate(stream, 1):
        if not line.strip():
            continue
        where = f"{url}:{lineno}"
        try:
            yield where, json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(field, f"{where}: not UTF-8 text (a binary file of another kind?)") from None
        except ValueError as e:
            raise ConfigError(field, f"{where}: not a JSON object ({getattr(e, 'msg', e)})") from None


def _table_rows(url: str, raw, kind: str, field: str) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            batches = pq.ParquetFile(raw).iter_batches(batch_size=_TABLE_BATCH)
        elif kind == "arrow-file":
            reader = pa.ipc.open_file(raw)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(pa.ipc.open_stream(raw))
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield f"{url} row {n}", row
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(field, f"{url}: not a readable {kind.split('-')[0]} file ({e})") from None
