"""The storage interface every checkpoint path goes through, for a directory/PVC and for S3 alike.

Keys are '/'-separated paths relative to the store root (`iter_0000020/model_rank0.pt`). Nothing here
imports torch or boto3, so the operator can read progress logs and trackers cheaply.

Visibility rules (the same on both backends):
  * `open_write`/`write_bytes`/`replace_tracker`: an object appears under its key whole or not at all.
  * `begin_dir(name)` ... `txn.commit(marker)`: a checkpoint directory counts only once `name/metadata.json`
    (the marker, written last) exists; `committed(name)` tells. Readers ignore directories without it.

Multi-rank transactions (several processes write files into one checkpoint directory):
    every rank:   txn = store.begin_dir(name, txn_id=tid)   # primary: RANK == 0 unless `primary=` given
                  with txn.open_write(f"model_rank{r}.pt") as f: torch.save(state, f)
    barrier                                    # every rank's files are complete (each write is fsynced
                                               # / its upload completed before `open_write` returns)
    primary:      txn.sweep(every rank's txn.written)   # S3: what an older copy left goes
                  txn.commit(marker_bytes)     # or txn.abort() if any rank failed
`tid` must be the same string on every rank and unique per save attempt (e.g. f"{run_id}-{iteration}"
with a run id broadcast from rank 0). On a filesystem it names the hidden temp directory
`.<name>.tmp-<tid>` all ranks write into, which the primary renames to `name` on commit; on S3 the files
go directly under `name/`. Re-saving an existing S3 directory: the primary's `begin_dir` deletes the old
marker (the directory stops counting), and `sweep`, once every rank's writes are done, deletes whatever this
save did not write: never earlier, as another rank may be rewriting one of those keys at that moment.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import io
import os
import re
from collections.abc import Collection
from contextlib import AbstractContextManager
from typing import BinaryIO, Self

from kubetron.contract.errors import CheckpointError

MARKER = "metadata.json"
"""The commit marker of a checkpoint directory, written last."""

# Hidden names the filesystem store uses: `.<name>.tmp-<id>` (a file or a txn directory in flight),
# `.<name>.old-<id>` (the previous copy of a directory being replaced) and `.<name>.del-<id>` (a directory
# being deleted: renamed away first, so a killed delete never leaves a marker over half-deleted files).
TEMP_NAME_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|del)-(?P<id>[A-Za-z0-9_\-]+)$")
TXN_ID_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
# The S3 store marks an open transaction with this object inside the directory (removed on commit).
PENDING_NAME = ".kubetron-pending"


def is_internal_name(component: str) -> bool:
    """True for path components that only the storage layer itself uses (readers skip them)."""
    return component == PENDING_NAME or TEMP_NAME_RE.match(component) is not None


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Normalise a relative key ('a/b/c'); reject absolute paths, '..' and internal names."""
    if not isinstance(key, str):
        raise TypeError(f"storage key must be a str, got {type(key).__name__}")
    k = key.strip("/")
    if not k:
        if allow_empty:
            return ""
        raise ValueError("empty storage key")
    parts = k.split("/")
    for p in parts:
        if p in ("", ".", ".."):
            raise ValueError(f"bad storage key {key!r}: empty, '.' or '..' component")
        if is_internal_name(p):
            raise ValueError(f"bad storage key {key!r}: {p!r} is reserved for the storage layer")
    return k


def too_large(what: str, size: int, limit: int) -> CheckpointError:
    """An object bigger than its reader's limit (Store.read_bytes)."""
    return CheckpointError(f"{what} is {size} bytes, more than the {limit} bytes such a file may hold: "
                           "refusing to read it")


def default_primary(primary: bool | None) -> bool:
    if primary is not None:
        return primary
    return int(os.environ.get("RANK", "0") or 0) == 0


def join_key(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class DirTxn(abc.ABC):
    """One checkpoint directory being written. See the module docstring for the multi-rank protocol.

    Used as a context manager, an exception inside the block aborts the transaction; leaving the block
    normally does NOT commit (call `commit` explicitly, on one process).
    """

    name: str
    txn_id: str
    primary: bool
    _open: int = 0  # writes in progress in this process
    _failed: list[str]  # relkeys whose write raised
    _done: bool = False  # committed or aborted
    written: list[str]  # relkeys this process wrote through this transaction (sweep's `keep`, from every rank)

    @abc.abstractmethod
    def _what(self, relkey: str = "") -> str:
        """A human name for `name/relkey` in error messages."""

    @abc.abstractmethod
    def _open_object(self, relkey: str) -> AbstractContextManager[BinaryIO]:
        """The backend's writable stream for `name/relkey` (already checked)."""

    @abc.abstractmethod
    def _commit(self, marker: bytes) -> None:
        """The backend's commit, once the common checks passed."""

    @contextlib.contextmanager
    def open_write(self, relkey: str):
        """A writable stream for `name/relkey`; durable (fsynced / upload completed) on a clean exit."""
        rk = check_key(relkey)
        if rk == MARKER:
            raise ValueError(f"{MARKER} is written by commit()")
        if self._done:
            raise CheckpointError(f"{self._what()}: transaction already finished")
        self._open += 1
        try:
            with self._open_object(rk) as f:
                yield f
        except BaseException:
            self._failed.append(rk)
            raise
        finally:
            self._open -= 1
        self.written.append(rk)

    def sweep(self, keep: Collection[str]) -> list[str]:
        """Primary, once every rank's writes are done (after a barrier), before `commit`: remove what lies in
        the directory that this save did not write (`keep`: every rank's `written`), an older copy's or a killed
        attempt's files, so none of it ends up beside the new marker; the removed relkeys. A filesystem store
        needs none (its save is a fresh directory renamed into place): nothing is removed."""
        return []

    def write_bytes(self, relkey: str, data: bytes) -> None:
        with self.open_write(relkey) as f:
            f.write(data)

    def local_dir(self, relkey: str) -> str | None:
        """A local directory that becomes `name/relkey` at commit, for writers that need a filesystem
        path (megatron's dist_checkpointing); None when the store is not a filesystem (stage, then copy
        through open_write). Files written there are fsynced by the commit."""
        return None

    def commit(self, marker: bytes) -> None:
        """Make the directory visible: write the marker last (FS: then rename the directory into place).

        Raises CheckpointError if a write through this txn failed or is still open in this process.
        """
        if not self.primary:
            raise CheckpointError(f"{self._what()}: only the primary process commits")
        if self._done:
            raise CheckpointError(f"{self._what()}: transaction already finished")
        if self._failed or self._open:
            raise CheckpointError(
                f"{self._what()}: not committing, writes failed {self._failed} or still open ({self._open})"
            )
        self._commit(marker)

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard what was written. Never touches a previously committed copy on a filesystem."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            with contextlib.suppress(Exception):  # the original error matters more
                self.abort()


class Store(abc.ABC):
    """A checkpoint store: a local/PVC directory or an `s3://bucket/prefix`. See the module docstring."""

    url: str
    is_remote: bool

    # -- objects ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def open_write(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A write-only sequential stream (supports write/flush/tell; enough for `torch.save(obj, f)`).

        The object appears atomically under `key` only when the block exits without error; on error
        nothing (not even a partial object) is left. Storage failures raise CheckpointError naming the key.
        """

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.open_write(key) as f:
            f.write(data)

    @abc.abstractmethod
    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        """The whole object. FileNotFoundError if it does not exist. `limit`: an object larger than this many
        bytes is a CheckpointError before its bytes are held in memory (what a store holds is hostile input:
        a reader of an index or a marker asks for what such a file can sensibly be)."""

    @abc.abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A seekable binary reader (enough for `torch.load`). FileNotFoundError if missing."""

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes of `key` from byte `start` (a sharded load reads only the tensors it needs).
        Raises CheckpointError when the object is shorter, before a buffer of `length` bytes exists (the
        range may come from a checkpoint's own index: hostile input)."""
        with self.open_read(key) as f:
            size = f.seek(0, io.SEEK_END)
            if start < 0 or length < 0 or start + length > size:
                raise CheckpointError(f"{self.url}/{key}: expected {length} bytes at offset {start}, the object "
                                      f"holds {size}")
            f.seek(start)
            data = f.read(length)
        if len(data) != length:
            raise CheckpointError(f"{self.url}/{key}: expected {length} bytes at offset {start}, got {len(data)}")
        return data

    def read_ranges(self, requests: list[tuple[str, int, int]]) -> list[bytes | memoryview]:
        """`read_range` of each (key, start, length), in order (a sharded load's reads, all at once: a store
        that fetches them together overrides it; bytes or views of a buffer of its own)."""
        return [self.read_range(key, start, length) for key, start, length in requests]

    def local_path(self, key: str) -> str | None:
        """The filesystem path of `key`, or None when the store is not a filesystem."""
        return None

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All keys under the directory `prefix` (recursive, sorted, relative to the store root).

        Internal temp names (in-flight writes, uncommitted FS transactions) are never listed.
        """

    @abc.abstractmethod
    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        """Names (not paths) of the immediate subdirectories of `prefix`, sorted, internal ones skipped.

        A directory is listed whether committed or not: filter with `committed()`.
        """

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete the object or the whole directory `prefix` (recursive). A missing prefix is fine."""

    @abc.abstractmethod
    def append_line(self, key: str, line: str) -> None:
        """Append one line (a newline is added if missing) durably. Single writer only (rank 0)."""

    def replace_tracker(self, key: str, data: bytes) -> None:
        """Atomically replace a small object (the tracker): temp+fsync+rename on a FS, one PUT on S3."""
        self.write_bytes(key, data)

    # -- checkpoint directories -------------------------------------------------------------------------
    @abc.abstractmethod
    def begin_dir(self, name: str, *, txn_id: str | None = None, primary: bool | None = None) -> DirTxn:
        """Start writing the checkpoint directory `name` (e.g. 'iter_0000020' or 'non_persistent/iter_..').

        `txn_id`: the same string on every rank writing into this directory (default: a fresh uuid, for
        single-process saves). `primary`: the one process that prepares and later commits/aborts
        (default: True when the RANK environment variable is unset or 0).
        Re-saving an existing `name` replaces it: on a filesystem the old copy stays intact and visible
        until the new one is renamed into place; on S3 (no rename) the primary deletes the old marker
        first, so the old copy stops counting at `begin_dir` time.
        """

    def committed(self, name: str) -> bool:
        """True when `name/metadata.json` (the commit marker) exists."""
        return self.exists(join_key(check_key(name), MARKER))

    @abc.abstractmethod
    def cleanup_partial(self, *, min_age_s: float = 0.0) -> builtins.list[str]:
        """Remove what killed saves left behind; returns what was removed (for logging).

        FS: hidden temp files/directories (`.x.tmp-*`, `.x.old-*`); a complete temp directory whose
        final name is missing (a crash mid-replace) is renamed into place instead. S3: directories
        still marked pending (never committed) and dangling multipart uploads under the prefix.
        Only call it while no save is in flight (e.g. rank 0 at startup, before the first save);
        `min_age_s` skips entries younger than that as an extra guard.
        """

    def close(self) -> None:  # noqa: B027 - an optional hook; nothing to release on a filesystem
        """Release thread pools / connections. The store must not be used afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class MemoryReader(io.RawIOBase):
    """A read-only seekable stream over a buffer, without copying it (what `open_read` returns on S3)."""

    def __init__(self, buf: bytes | bytearray | memoryview):
        super().__init__()
        self._mv = memoryview(buf).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._mv)

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = len(self._mv) + offset
        else:
            raise ValueError(f"bad whence {whence}")
        if pos < 0:
            raise ValueError("negative seek position")
        self._pos = pos
        return pos

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._mv) - self._pos))
        out[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        start = min(self._pos, end)
        self._pos = max(self._pos, end)
        return bytes(self._mv[start:end])

    def readall(self) -> bytes:
        return self.read(-1)

    def getbuffer(self) -> memoryview:
        return self._mv

    def close(self) -> None:
        self._mv = memoryview(b"")
        super().close()
