"""Memory snapshots as files (docs/recovery.md): where they live, their manifest, how one is made visible whole,
and how one is opened and checked before anything of it is read. Torch-free: the pod's agent
(kubetron.supervisor.peers) lists, checks and copies them without importing torch.

    <root>/own/rank_00003/snap_0000020/       rank 3 of this pod, iteration 20 (<root>: the pod's memory volume)
        shards/rank_00003.bin  .json          its pieces of the sharded checkpoint (format_sharded's files)
        common.pt  rng.pt                     counters, scheduler, data position, param groups; its RNG states
        manifest.json                         written last: iteration, rank, world size, each file's size and
                                              the SHA-256 of each CHUNK of it
    <root>/peers/rank_00005/snap_0000020/     the same, a copy of another pod's rank 5 (sent by its agent)
    <parent>/.snap_0000020.tmp-<id>/          in flight: renamed to snap_0000020 once complete, never read

A snapshot is written beside (the temp name), its manifest last, then renamed into place; a reader opens its
files, checks their sizes against the manifest and, before it serves a byte, their digests. So a torn write,
a copy cut off half-way or a flipped byte is never loaded, and a file deleted while it is read (a newer
snapshot replacing it) stays readable through the descriptors already open. At most KEEP snapshots of a rank
exist in one parent: before a new one is written, all but the newest complete one are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kubetron.contract.errors import CheckpointError
from kubetron.contract.recovery import KEEP

OWN, PEERS = "own", "peers"
MANIFEST = "manifest.json"
COPIED = "copied"  # in a rank's own directory: the newest iteration its pod's agent sent to every holder
COMMON_FILE, RNG_FILE = "common.pt", "rng.pt"
CHUNK = 64 << 20  # bytes per digest: a file's chunks are checked in parallel
MAX_MANIFEST = 1 << 20  # bytes
MAX_FILE = 1 << 44  # bytes: a file size a manifest may declare (16 TiB: never a real shard)
FORMAT = 1
_SNAP_RE = re.compile(r"^snap_(\d{7,})$")
_RANK_RE = re.compile(r"^rank_(\d{5,})$")
_FILE_RE = re.compile(r"^(shards/rank_\d{5,}\.(bin|json)|common\.pt|rng\.pt)$")
_RUN_RE = re.compile(r"^[0-9a-f]{0,64}$")
_TEMP_PREFIX = "."


def snap_name(iteration: int) -> str:
    return f"snap_{iteration:07d}"


def rank_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def own_dir(root: str | Path, rank: int) -> Path:
    return Path(root, OWN, rank_name(rank))


def peer_dir(root: str | Path, rank: int) -> Path:
    return Path(root, PEERS, rank_name(rank))


def parse_rank_dir(name: str) -> int | None:
    m = _RANK_RE.match(name)
    return int(m.group(1)) if m else None


# -- the manifest -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What a snapshot holds: its files' sizes and chunk digests (hex SHA-256 of each CHUNK bytes)."""

    iteration: int
    rank: int
    world_size: int
    files: dict[str, tuple[int, tuple[str, ...]]]  # relative path -> (size, digests)
    run: str = ""  # the run that wrote it (`run_identity`): a directory shared by two runs serves each its own

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "iteration": self.iteration, "rank": self.rank,
                           "worldSize": self.world_size, "run": self.run, "chunk": CHUNK,
                           "files": {k: {"size": s, "sha256": list(d)} for k, (s, d) in sorted(self.files.items())}},
                          indent=1).encode()


def _count(v) -> bool:
    return type(v) is int and v >= 0


def parse_manifest(data: bytes, what: str) -> Manifest:
    """A manifest as written by `write_snapshot`, checked (it is read from a volume, or from a peer): a
    CheckpointError naming `what` otherwise."""
    if len(data) > MAX_MANIFEST:
        raise CheckpointError(f"{what}: more than {MAX_MANIFEST} bytes")
    try:
        m = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{what} is not JSON: {type(e).__name__}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("chunk") != CHUNK \
            or not all(_count(m.get(k)) for k in ("iteration", "rank", "worldSize")) or m["worldSize"] < 1 \
            or m["rank"] >= m["worldSize"] or not isinstance(m.get("files"), dict) \
            or not isinstance(m.get("run", ""), str) or not _RUN_RE.match(m.get("run", "")):
        raise CheckpointError(f"{what}: not a snapshot manifest (format {FORMAT}: iteration, rank, worldSize, run, "
                              "files)")
    files: dict[str, tuple[int, tuple[str, ...]]] = {}
    for rel, entry in m["files"].items():
        if not _FILE_RE.match(rel) or not isinstance(entry, dict) or not _count(entry.get("size")) \
                or entry["size"] > MAX_FILE or not isinstance(entry.get("sha256"), list):
            raise CheckpointError(f"{what}: bad file entry {rel[:80]!r}")
        digests = entry["sha256"]
        if len(digests) != max(1, -(-entry["size"] // CHUNK)) or not all(
                isinstance(d, str) and re.fullmatch(r"[0-9a-f]{64}", d) for d in digests):
            raise CheckpointError(f"{what}: {rel} has no digest per {CHUNK} bytes")
        files[rel] = (entry["size"], tuple(digests))
    return Manifest(m["iteration"], m["rank"], m["worldSize"], files, m.get("run", ""))


def run_identity(job: str, save: str) -> str:
    """Who a snapshot belongs to: the job (`<namespace>/<job>` of KUBETRON_JOB_ID, its attempt left out: a new
    attempt continues the run) and its durable store (`checkpoint.save`), hashed. A run resumes only from its own
    snapshots: a fresh run in a directory another run left snapshots in starts from its own store."""
    return hashlib.sha256(f"{job}\n{save}".encode()).hexdigest()[:32]


# -- writing ----------------------------------------------------------------------------------------


class _HashingFile:
    """A file being written whose CHUNK-sized pieces are hashed as they pass."""

    def __init__(self, f: BinaryIO):
        self.f, self.size = f, 0
        self.digests: list[str] = []
        self._h = hashlib.sha256()
        self._in_chunk = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self.f.write(view)
        while view.nbytes:
            take = min(CHUNK - self._in_chunk, view.nbytes)
            self._h.update(view[:take])
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == CHUNK:
                self.digests.append(self._h.hexdigest())
                self._h, self._in_chunk = hashlib.sha256(), 0
        self.size += n
        return n

    def finish(self) -> tuple[int, tuple[str, ...]]:
        if self._in_chunk or not self.digests:
            self.digests.append(self._h.hexdigest())
        return self.size, tuple(self.digests)


class SnapshotWriter:
    """The files of one snapshot being written into its temp directory (what format_sharded.write takes as
    a transaction: `open_write`, `write_bytes`)."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.files: dict[str, tuple[int, tuple[str, ...]]] = {}

    @contextlib.contextmanager
    def open_write(self, relkey: str) -> Iterator[_HashingFile]:
        if not _FILE_RE.match(relkey):
            raise ValueError(f"a snapshot has no file {relkey!r}")
        path = self.dir / relkey
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "xb") as f:
            hashing = _HashingFile(f)
            yield hashing
        self.files[relkey] = hashing.finish()

    def write_bytes(self, relkey: str, data: bytes) -> None:
        with self.open_write(relkey) as f:
            f.write(data)


def _iterations(parent: Path) -> list[int]:
    """Complete snapshots in `parent` (renamed into place; a manifest), oldest first; not yet checked."""
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            m = _SNAP_RE.match(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(entry.path, MANIFEST)):
                out.append(int(m.group(1)))
    return sorted(out)


def iterations(parent: str | Path) -> list[int]:
    return _iterations(Path(parent))


def _remove(path: Path) -> None:
    """Rename away first, then delete: a half-deleted snapshot never keeps its name (nor its manifest)."""
    gone = path.with_name(f"{_TEMP_PREFIX}{path.name}.del-{uuid.uuid4().hex[:8]}")
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, gone)
        shutil.rmtree(gone, ignore_errors=True)


def remove_partial(parent: str | Path) -> None:
    """What a killed writer left in `parent` (temp and half-deleted directories). Only its one writer calls it."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if entry.name.startswith(_TEMP_PREFIX):
                shutil.rmtree(entry.path, ignore_errors=True)


def prune(parent: str | Path, keep: int) -> None:
    """Remove all but the newest `keep` complete snapshots of `parent`."""
    for it in _iterations(Path(parent))[:-keep] if keep else _iterations(Path(parent)):
        _remove(Path(parent, snap_name(it)))


def mark_copied(parent: str | Path, iteration: int) -> None:
    """Record that the snapshot of `iteration` in `parent` went to every pod that holds its copies (written
    beside, then renamed: a reader sees the old mark or the new)."""
    tmp = Path(parent, f"{_TEMP_PREFIX}{COPIED}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(str(iteration))
    os.replace(tmp, Path(parent, COPIED))


def copied(parent: str | Path) -> int | None:
    """The iteration `mark_copied` recorded last in `parent` (None: none, or not a number)."""
    try:
        text = Path(parent, COPIED).read_text()[:20]
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def drop_newer(parent: str | Path, iteration: int) -> None:
    """Remove the complete snapshots of `parent` newer than `iteration`."""
    for it in _iterations(Path(parent)):
        if it > iteration:
            _remove(Path(parent, snap_name(it)))


def write_snapshot(parent: str | Path, manifest_of: Callable[[dict], Manifest],
                   write: Callable[[SnapshotWriter], None], iteration: int) -> Path:
    """Write a snapshot into `parent`: first all but the newest complete one are removed (so at most KEEP
    exist), then `write(writer)` fills a temp directory, the manifest (`manifest_of(files)`) goes in last
    and the directory is renamed into place. On an error nothing new is left."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    prune(parent, KEEP - 1)
    tmp = parent / f"{_TEMP_PREFIX}{snap_name(iteration)}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        tmp.mkdir()
        writer = SnapshotWriter(tmp)
        write(writer)
        (tmp / MANIFEST).write_bytes(manifest_of(writer.files).to_json())
        final = parent / snap_name(iteration)
        if final.exists():  # the same iteration again (a resume that reached it before): the new one wins
            _remove(final)
        os.rename(tmp, final)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- reading ----------------------------------------------------------------------------------------


class OpenSnapshot:
    """A complete snapshot's files, open (descriptors: a newer snapshot deleting them cannot cut a read short),
    their sizes checked against the manifest. `verify()` checks the digests; `read` reads a byte range."""

    def __init__(self, directory: str | Path, *, rank: int | None = None, world_size: int | None = None):
        self.dir = Path(directory)
        what = str(self.dir)
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        try:
            data = _read_all(self.dir / MANIFEST, MAX_MANIFEST, what)
            self.manifest = parse_manifest(data, f"{what}/{MANIFEST}")
            m = self.manifest
            if rank is not None and m.rank != rank:
                raise CheckpointError(f"{what} holds rank {m.rank}'s snapshot, not rank {rank}'s")
            if world_size is not None and m.world_size != world_size:
                raise CheckpointError(f"{what} was written by a gang of {m.world_size} ranks, this one has "
                                      f"{world_size}")
            for rel, (size, _) in m.files.items():
                fd = self._fds[rel] = os.open(self.dir / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise CheckpointError(f"{what}/{rel} holds {actual} bytes, its manifest says {size}: a torn write")
        except OSError as e:
            self.close()
            raise CheckpointError(f"cannot read snapshot {what}: {e.strerror or e}") from None
        except BaseException:
            self.close()
            raise

    @property
    def iteration(self) -> int:
        return self.manifest.iteration

    def size(self, rel: str) -> int:
        return self.manifest.files[rel][0]

    def read(self, rel: str, start: int, length: int) -> bytearray:
        """Bytes [start, start + length) of file `rel`, inside its size (checked before any buffer exists)."""
        self._check_range(rel, start, length)
        buf = bytearray(length)
        self._fill(rel, start, memoryview(buf))
        return buf

    def read_into(self, rel: str, start: int, view: memoryview) -> None:
        """Bytes [start, start + len(view)) of file `rel` straight into `view` (a gang's send buffer: no copy)."""
        self._check_range(rel, start, len(view))
        self._fill(rel, start, view)

    def mapped(self, rel: str, start: int, length: int) -> memoryview:
        """Bytes [start, start + length) of file `rel` as a read-only view of the file mapped into memory (a rank's
        own share of a load: no buffer, no copy; `verify()` first). A complete snapshot's files never change (a newer
        one unlinks them; a mapping outlives that), so the view reads what was verified."""
        self._check_range(rel, start, length)
        if not length:
            return memoryview(b"")
        mapping = self._maps.get(rel)
        if mapping is None:
            mapping = self._maps[rel] = mmap.mmap(self._fds[rel], 0, access=mmap.ACCESS_READ)
        return memoryview(mapping)[start:start + length]

    def _fill(self, rel: str, start: int, view: memoryview) -> None:
        length, done = len(view), 0
        while done < length:
            n = os.preadv(self._fds[rel], [view[done:]], start + done)
            if n <= 0:
                raise CheckpointError(f"{self.dir}/{rel}: ended at {start + done} bytes of {start + length}")
            done += n

    def _check_range(self, rel: str, start: int, length: int) -> None:
        size = self._size_of(rel)
        if start < 0 or length < 0 or start + length > size:
            raise CheckpointError(f"{self.dir}/{rel}: expected {length} bytes at offset {start}, it holds {size}")

    def read_all(self, rel: str, limit: int) -> bytes:
        size = self._size_of(rel)
        if size > limit:
            raise CheckpointError(f"{self.dir}/{rel} is {size} bytes, more than the {limit} such a file may hold")
        return bytes(self.read(rel, 0, size))

    def _size_of(self, rel: str) -> int:
        if rel not in self._fds:
            raise FileNotFoundError(f"{self.dir}/{rel}")
        return self.manifest.files[rel][0]

    def verify(self, threads: int = 4) -> None:
        """Every chunk's SHA-256 against the manifest (hashlib releases the GIL: chunks in parallel)."""
        jobs = [(rel, i) for rel, (_, digests) in self.manifest.files.items() for i in range(len(digests))]
        with ThreadPoolExecutor(max(1, min(threads, len(jobs)))) as pool:
            for (rel, i), ok in zip(jobs, pool.map(lambda job: self._chunk_ok(*job), jobs), strict=True):
                if not ok:
                    raise CheckpointError(f"{self.dir}/{rel}: bytes {i * CHUNK}.. do not match their checksum "
                                          "(a torn or corrupted snapshot)")

    def _chunk_ok(self, rel: str, i: int) -> bool:
        size, digests = self.manifest.files[rel]
        start = i * CHUNK
        data = self.read(rel, start, min(CHUNK, size - start))
        return hashlib.sha256(data).hexdigest() == digests[i]

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}
        for mapping in self._maps.values():
            with contextlib.suppress(BufferError):  # views still held (a loader's): unmapped with the last of them
                mapping.close()
        self._maps = {}

    def __enter__(self) -> OpenSnapshot:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_all(path: Path, limit: int, what: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise CheckpointError(f"{what}/{path.name}: more than {limit} bytes")
    return data
