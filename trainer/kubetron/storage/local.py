"""Filesystem / PVC store: temp name + fsync + rename for every object, renamed temp dirs for checkpoints."""

from __future__ import annotations

import builtins
import ctypes
import errno
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from kubetron.contract.errors import CheckpointError
from kubetron.storage.base import (
    MARKER,
    TEMP_NAME_RE,
    TXN_ID_RE,
    DirTxn,
    Store,
    check_key,
    default_primary,
    is_internal_name,
)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems (e.g. certain FUSE/NFS mounts) refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _makedirs(path: str) -> None:
    """mkdir -p, fsyncing each parent whose entry list changed (so new directories survive a crash)."""
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        _fsync_dir(os.path.dirname(d))


@contextmanager
def _atomic_file(path: str, what: str) -> Iterator[BinaryIO]:
    """Write `path` through `.<name>.tmp-<uuid>` in the same directory; fsync, rename, fsync the dir."""
    parent, base = os.path.split(path)
    tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex}")
    try:
        _makedirs(parent)
        f = open(tmp, "wb")  # noqa: SIM115 - closed below on every path
    except OSError as e:
        raise CheckpointError(f"cannot write {what}: {e}") from e
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        _fsync_dir(parent)
    except BaseException as e:
        try:
            f.close()
        except OSError:
            pass
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise CheckpointError(f"writing {what} failed: {e}") from e
        raise


# renameat2(RENAME_EXCHANGE): swap two directories atomically (Linux >= 3.15; not every filesystem).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
except (AttributeError, OSError):  # pragma: no cover - non-glibc
    _renameat2 = None


def _exchange(a: str, b: str) -> bool:
    """Atomically swap paths a and b. False if the platform/filesystem cannot (caller falls back)."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), a)


def _fsync_tree(path: str) -> None:
    for dirpath, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


class LocalStore(Store):
    """A directory (local disk or a mounted PVC). The root is created on the first write."""

    is_remote = False

    def __init__(self, path: str):
        self.root = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.url = self.root

    def _path(self, key: str) -> str:
        k = check_key(key, allow_empty=True)
        return os.path.join(self.root, *k.split("/")) if k else self.root

    def _what(self, key: str) -> str:
        return os.path.join(self.url, key)

    # -- objects ---------------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        k = check_key(key)
        with _atomic_file(self._path(k), self._what(k)) as f:
            yield f

    def read_bytes(self, key: str) -> bytes:
        with open(self._path(check_key(key)), "rb") as f:
            return f.read()

    def open_read(self, key: str) -> BinaryIO:
        return open(self._path(check_key(key)), "rb")  # the caller closes it

    def local_path(self, key: str) -> str:
        return self._path(check_key(key))

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(check_key(key)))

    def list(self, prefix: str = "") -> list[str]:
        p = check_key(prefix, allow_empty=True)
        base = self._path(p)
        out = []
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if not is_internal_name(d)]
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in files:
                if not is_internal_name(name):
                    out.append(name if rel == "." else f"{rel}/{name}")
        return sorted(out)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        base = self._path(check_key(prefix, allow_empty=True))
        try:
            entries = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.name for e in entries if e.is_dir() and not is_internal_name(e.name))

    def delete_prefix(self, prefix: str) -> None:
        k = check_key(prefix)  # never the whole store
        path = self._path(k)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                # rename away first: a delete killed halfway never leaves a marker over missing files
                parent, base = os.path.split(path)
                gone = os.path.join(parent, f".{base}.del-{uuid.uuid4().hex}")
                os.rename(path, gone)
                _fsync_dir(parent)
                shutil.rmtree(gone, ignore_errors=True)
            elif os.path.lexists(path):
                os.unlink(path)
                _fsync_dir(os.path.dirname(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CheckpointError(f"deleting {self._what(k)} failed: {e}") from e

    def append_line(self, key: str, line: str) -> None:
        k = check_key(key)
        path = self._path(k)
        if not line.endswith("\n"):
            line += "\n"
        try:
            _makedirs(os.path.dirname(path))
            new = not os.path.exists(path)
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            if new:
                _fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise CheckpointError(f"appending to {self._what(k)} failed: {e}") from e

    # -- checkpoint directories -------------------------------------------------------------------------
    def begin_dir(self, name: str, *, txn_id: str | None = None, primary: bool | None = None) -> DirTxn:
        return _LocalDirTxn(self, check_key(name), txn_id or uuid.uuid4().hex, default_primary(primary))

    def cleanup_partial(self, *, min_age_s: float = 0.0) -> builtins.list[str]:
        if not os.path.isdir(self.root):
            return []
        now = time.time()
        done: list[str] = []
        for dirpath, dirs, files in os.walk(self.root):
            # 'tmp' before 'old': a complete new copy wins over the old one it was replacing
            internal = sorted(
                (m.group("kind") != "tmp", n, m) for n in dirs + files if (m := TEMP_NAME_RE.match(n)) is not None
            )
            dirs[:] = [d for d in dirs if not is_internal_name(d)]
            for _, n, m in internal:
                p = os.path.join(dirpath, n)
                try:
                    if now - os.lstat(p).st_mtime < min_age_s:
                        continue
                    final = os.path.join(dirpath, m.group("name"))
                    rel = os.path.relpath(p, self.root)
                    if os.path.isdir(p) and not os.path.islink(p):
                        if (
                            m.group("kind") in ("tmp", "old")
                            and os.path.isfile(os.path.join(p, MARKER))
                            and not os.path.lexists(final)
                        ):
                            os.rename(p, final)  # a crash between the two renames of a replace
                            _fsync_dir(dirpath)
                            done.append(f"{rel} -> {m.group('name')} (restored)")
                            if m.group("name") not in dirs:
                                dirs.append(m.group("name"))
                            continue
                        shutil.rmtree(p)
                    else:
                        os.unlink(p)
                    done.append(rel)
                except FileNotFoundError:
                    continue
        return done


class _LocalDirTxn(DirTxn):
    def __init__(self, store: LocalStore, name: str, txn_id: str, primary: bool):
        if not TXN_ID_RE.match(txn_id):
            raise ValueError(f"txn_id must match {TXN_ID_RE.pattern}, got {txn_id!r}")
        self.store, self.name, self.txn_id, self.primary = store, name, txn_id, primary
        self.final = store._path(name)
        parent, base = os.path.split(self.final)
        self.parent = parent
        self.tmp = os.path.join(parent, f".{base}.tmp-{txn_id}")
        self._open = 0
        self._failed: list[str] = []
        self._done = False
        try:
            _makedirs(self.tmp)
        except OSError as e:
            raise CheckpointError(f"cannot create {self.tmp} for {store._what(name)}: {e}") from e

    def _what(self, relkey: str = "") -> str:
        return self.store._what(f"{self.name}/{relkey}" if relkey else self.name)

    @contextmanager
    def _open_object(self, rk: str) -> Iterator[BinaryIO]:
        with _atomic_file(os.path.join(self.tmp, *rk.split("/")), self._what(rk)) as f:
            yield f

    def local_dir(self, relkey: str) -> str:
        path = os.path.join(self.tmp, *check_key(relkey).split("/"))
        try:
            _makedirs(path)
        except OSError as e:
            raise CheckpointError(f"cannot create {path} for {self._what(relkey)}: {e}") from e
        return path

    def _commit(self, marker: bytes) -> None:
        if not os.path.isdir(self.tmp):
            raise CheckpointError(f"{self._what()}: temp directory {self.tmp} vanished before commit")
        try:
            _fsync_tree(self.tmp)  # other ranks' files too (each rank also fsyncs its own)
            with _atomic_file(os.path.join(self.tmp, MARKER), self._what(MARKER)) as f:
                f.write(marker)
            if os.path.lexists(self.final):
                if _exchange(self.tmp, self.final):
                    _fsync_dir(self.parent)
                    shutil.rmtree(self.tmp, ignore_errors=True)  # holds the old copy now
                else:
                    old = os.path.join(self.parent, f".{os.path.basename(self.final)}.old-{self.txn_id}")
                    os.rename(self.final, old)
                    os.rename(self.tmp, self.final)
                    _fsync_dir(self.parent)
                    shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(self.tmp, self.final)
                _fsync_dir(self.parent)
        except OSError as e:
            raise CheckpointError(f"committing {self._what()} failed: {e}") from e
        self._done = True

    def abort(self) -> None:
        self._done = True
        if self.primary:  # a non-primary rank leaves the shared temp dir to the primary / cleanup_partial
            shutil.rmtree(self.tmp, ignore_errors=True)
