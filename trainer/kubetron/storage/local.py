"""Filesystem / PVC store: temp name + fsync + rename for every object, renamed temp dirs for checkpoints.

A store is hostile input (another tenant's writes on a shared claim, a checkpoint copied from elsewhere), and
kubetron itself never puts a symbolic link in one. So below the root (which the user named, and may be a
link) no link is ever followed: every path is walked one component at a time from a directory descriptor
with O_NOFOLLOW, so a link planted anywhere (`iter_N/tokenizer/x -> /proc/self/environ`, `iter_N -> /`) is
never read, written, listed into or deleted through, and a swap between a check and the open cannot win.
What each operation does on meeting one:
  * reading a file (read_bytes, open_read, read_range, local_path): refused with a CheckpointError naming it;
    the caller asked for a checkpoint file, and a link is not the file that was saved;
  * exists(): a link counts as an entry, so the read that follows refuses it loudly instead of the run
    silently taking another path (a linked tracker, optim.pt or commit marker is tampering, not absence);
  * list(): links are listed like files, for the same reason (a tokenizer/ with a file left out would
    silently change the tokenizer); list_dirs(): a linked directory is not a directory of this store (it
    is no checkpoint kubetron wrote), so it is ignored;
  * writing, appending, creating directories, deleting: a link in the path is refused; a link in the
    final place is replaced or removed as an entry (rename and unlink never follow).
Anything else that is not a regular file (a FIFO, a device) is refused where it would be read.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import os
import shutil
import stat
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
    too_large,
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
    """mkdir -p, fsyncing each parent whose entry list changed (so new directories survive a crash). For the
    store's root only: below it, directories are made by LocalStore._dir(create=True), which follows no link."""
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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a planted FIFO never blocks


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:  # as _fsync_dir: some filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def link_refused(what: str) -> CheckpointError:
    return CheckpointError(f"{what} is a symbolic link: kubetron never follows a link inside a store "
                           "(it writes none), so this is not a file it saved")


def _open_at(dir_fd: int, name: str, flags: int, what: str, mode: int = 0o644) -> int:
    """os.open(name, flags | O_NOFOLLOW) in the directory `dir_fd`; a link there is a CheckpointError."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and _is_link(dir_fd, name):
            raise link_refused(what) from None
        raise


def _regular(fd: int, what: str) -> int:
    """`fd` if it is a regular file; otherwise closed, and a CheckpointError (a FIFO or device never is data)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{what} is not a regular file")
    return fd


@contextmanager
def _atomic_file(dir_fd: int, base: str, what: str) -> Iterator[BinaryIO]:
    """Write `base` in the directory `dir_fd` through `.<base>.tmp-<uuid>`; fsync, rename, fsync the dir.
    The rename replaces whatever entry `base` was (a planted link too) and never follows it."""
    tmp = f".{base}.tmp-{uuid.uuid4().hex}"
    try:
        f = os.fdopen(_open_at(dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what), "wb")
    except OSError as e:
        raise CheckpointError(f"cannot write {what}: {e}") from e
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        _fsync_fd(dir_fd)
    except BaseException as e:
        try:
            f.close()
        except OSError:
            pass
        try:
            os.unlink(tmp, dir_fd=dir_fd)
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
    for dirpath, _dirs, files in os.walk(path, topdown=False):  # os.walk enters no linked directory
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), _READ_FLAGS)
            except OSError as e:  # a link (nothing kubetron wrote: it is not opened, let alone synced)
                if e.errno == errno.ELOOP:
                    continue
                raise
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


class LocalStore(Store):
    """A directory (local disk or a mounted PVC). The root is created on the first write. No link below the
    root is followed (the module docstring says what each operation does on meeting one)."""

    is_remote = False

    def __init__(self, path: str):
        self.root = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.url = self.root

    def _path(self, key: str) -> str:
        k = check_key(key, allow_empty=True)
        return os.path.join(self.root, *k.split("/")) if k else self.root

    def _what(self, key: str) -> str:
        return os.path.join(self.url, key)

    @contextmanager
    def _dir(self, parts: builtins.list[str], *, create: bool = False) -> Iterator[int]:
        """A descriptor of the directory root/parts..., walked one component at a time without following a
        link (a link on the way is a CheckpointError); `create`: make what is missing, fsyncing each parent."""
        if create and not os.path.isdir(self.root):
            _makedirs(self.root)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root: the user named it
        try:
            for i, name in enumerate(parts):
                nfd = self._subdir(fd, name, "/".join(parts[: i + 1]), create)
                os.close(fd)
                fd = nfd
            yield fd
        finally:
            os.close(fd)

    def _subdir(self, fd: int, name: str, rel: str, create: bool) -> int:
        try:
            return _open_at(fd, name, _DIR_FLAGS, self._what(rel))
        except FileNotFoundError:
            if not create:
                raise
        try:
            os.mkdir(name, dir_fd=fd)
        except FileExistsError:
            pass
        _fsync_fd(fd)
        return _open_at(fd, name, _DIR_FLAGS, self._what(rel))

    def _parts(self, key: str) -> builtins.list[str]:
        return check_key(key).split("/")

    def _open_file(self, key: str) -> BinaryIO:
        """`key` opened for reading: a regular file reached without following a link, else CheckpointError."""
        *parents, name = self._parts(key)
        what = self._what(key)
        with self._dir(parents) as d:
            return os.fdopen(_regular(_open_at(d, name, _READ_FLAGS, what), what), "rb")

    # -- objects ---------------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        *parents, name = self._parts(key)
        try:
            with self._dir(parents, create=True) as d, _atomic_file(d, name, self._what(key)) as f:
                yield f
        except (FileNotFoundError, NotADirectoryError) as e:
            raise CheckpointError(f"cannot write {self._what(key)}: {e}") from e

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        with self._open_file(key) as f:
            size = os.fstat(f.fileno()).st_size
            if limit is not None and size > limit:
                raise too_large(self._what(key), size, limit)
            data = f.read()
        if limit is not None and len(data) > limit:  # it grew while being read
            raise too_large(self._what(key), len(data), limit)
        return data

    def open_read(self, key: str) -> BinaryIO:
        return self._open_file(key)  # the caller closes it

    def local_path(self, key: str) -> str:
        """The path of `key`, once it is known to be a regular file reached without a link (a caller that
        hands the path on, e.g. to megatron, reads what was checked)."""
        with self._open_file(key):
            return self._path(key)

    def exists(self, key: str) -> bool:
        """A regular file, or a link (reading it is refused: see the module docstring), is there."""
        *parents, name = self._parts(key)
        try:
            with self._dir(parents) as d:
                mode = os.stat(name, dir_fd=d, follow_symlinks=False).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return False
        return not stat.S_ISDIR(mode)

    def list(self, prefix: str = "") -> builtins.list[str]:
        p = check_key(prefix, allow_empty=True)
        parts = p.split("/") if p else []
        out: builtins.list[str] = []
        try:
            with self._dir(parts) as d:
                self._list_into(d, p, out)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(out)

    def _list_into(self, fd: int, rel: str, out: builtins.list[str]) -> None:
        """Every entry under the directory `fd` that is not a directory: files, and links (listed, never
        entered: a reader of one is refused), depth first."""
        with os.scandir(fd) as entries:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries if not is_internal_name(e.name)]
        for name, is_dir in names:
            key = f"{rel}/{name}" if rel else name
            if not is_dir:
                out.append(key)
                continue
            sub = _open_at(fd, name, _DIR_FLAGS, self._what(key))
            try:
                self._list_into(sub, key, out)
            finally:
                os.close(sub)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        """Real directories only: a linked one holds nothing this store wrote, so it is no checkpoint."""
        p = check_key(prefix, allow_empty=True)
        try:
            with self._dir(p.split("/") if p else []) as d, os.scandir(d) as entries:
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False)
                              and not is_internal_name(e.name))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except CheckpointError:  # the prefix itself is (or passes) a link: no directory of this store
            return []

    def delete_prefix(self, prefix: str) -> None:
        *parents, name = self._parts(prefix)  # never the whole store
        try:
            with self._dir(parents) as d:
                self._delete_at(d, name)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CheckpointError(f"deleting {self._what(prefix)} failed: {e}") from e

    @staticmethod
    def _delete_at(d: int, name: str) -> None:
        try:
            is_dir = stat.S_ISDIR(os.stat(name, dir_fd=d, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return
        if not is_dir:  # a file or a link: the entry goes, what a link points at stays
            os.unlink(name, dir_fd=d)
            _fsync_fd(d)
            return
        # rename away first: a delete killed halfway never leaves a marker over missing files
        gone = f".{name}.del-{uuid.uuid4().hex}"
        os.rename(name, gone, src_dir_fd=d, dst_dir_fd=d)
        _fsync_fd(d)
        shutil.rmtree(gone, ignore_errors=True, dir_fd=d)  # fd-based: never descends a link

    def append_line(self, key: str, line: str) -> None:
        *parents, name = self._parts(key)
        what = self._what(key)
        if not line.endswith("\n"):
            line += "\n"
        try:
            with self._dir(parents, create=True) as d:
                new = not self.exists(key)
                fd = _regular(_open_at(d, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, what), what)
                with os.fdopen(fd, "a", encoding="utf-8") as f:
                    f.write(line)
                    f.flush()
                    os.fsync(f.fileno())
                if new:
                    _fsync_fd(d)
        except OSError as e:
            raise CheckpointError(f"appending to {what} failed: {e}") from e

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
        self._tmp_parts = [*name.split("/")[:-1], os.path.basename(self.tmp)]  # below the root, as _dir walks
        self._open = 0
        self._failed: list[str] = []
        self.written: list[str] = []
        self._done = False
        try:
            with store._dir(self._tmp_parts, create=True):  # a link on the way is refused
                pass
        except OSError as e:
            raise CheckpointError(f"cannot create {self.tmp} for {store._what(name)}: {e}") from e

    def _what(self, relkey: str = "") -> str:
        return self.store._what(f"{self.name}/{relkey}" if relkey else self.name)

    @contextmanager
    def _open_object(self, rk: str) -> Iterator[BinaryIO]:
        *parents, base = rk.split("/")
        with self.store._dir([*self._tmp_parts, *parents], create=True) as d, \
                _atomic_file(d, base, self._what(rk)) as f:
            yield f

    def local_dir(self, relkey: str) -> str:
        parts = check_key(relkey).split("/")
        path = os.path.join(self.tmp, *parts)
        try:
            with self.store._dir([*self._tmp_parts, *parts], create=True):
                pass
        except OSError as e:
            raise CheckpointError(f"cannot create {path} for {self._what(relkey)}: {e}") from e
        return path

    def _commit(self, marker: bytes) -> None:
        if not os.path.isdir(self.tmp):
            raise CheckpointError(f"{self._what()}: temp directory {self.tmp} vanished before commit")
        try:
            _fsync_tree(self.tmp)  # other ranks' files too (each rank also fsyncs its own)
            with self.store._dir(self._tmp_parts) as d, _atomic_file(d, MARKER, self._what(MARKER)) as f:
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
