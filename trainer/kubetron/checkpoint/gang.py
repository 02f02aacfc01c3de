"""Memory snapshots, the loading side (docs/recovery.md): the gang agrees on the newest iteration every rank
can load from the pods' memory, and loads it as the durable store's sharded checkpoints are loaded.

1. Every rank lists what its pod's memory volume holds that it can serve: its own snapshots, and the copies
   its pod holds of other pods' ranks (kubetron.supervisor.peers), each only when its manifest names that rank and this
   gang's world size. The lists are all-gathered, so every rank computes the same `agree()`: the newest
   iteration for which every rank of the gang has a source, its own snapshot first, else the lowest rank
   whose pod holds a copy. None, or one older than the durable store's newest checkpoint: the store, and
   the reason is said.
2. Each source opens what it serves and checks every byte against the manifest's digests; one failure on
   any rank sends every rank to the store, with that rank's reason.
3. The indexes, common state and RNG states go round (all-gather), and the store's own loading code
   (CheckpointManager._restore, format_sharded.ShardReader) reads the snapshot through `GangStore`, whose
   byte ranges come from the source that holds them: one all-to-all per read. Every byte is one a durable
   checkpoint of that iteration would hold, so a resume from memory continues exactly as one from the store.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetron.checkpoint import comm
from kubetron.checkpoint.format_sharded import index_key, shard_key
from kubetron.checkpoint.layout import COMMON, MAX_INDEX, MAX_SMALL, iter_dir, rng_file
from kubetron.contract.errors import CheckpointError
from kubetron.contract.recovery import MEMORY, PEER, TrainerRecovery
from kubetron.storage.base import Store
from kubetron.storage.snapshot_files import (
    COMMON_FILE,
    MANIFEST,
    PEERS,
    RNG_FILE,
    OpenSnapshot,
    iterations,
    own_dir,
    parse_manifest,
    parse_rank_dir,
    peer_dir,
    snap_name,
)

log = logging.getLogger("kubetron")

MAX_HOLDINGS = 1024  # (rank, iteration) entries one rank reports


# -- what every rank can serve, and the agreement --------------------------------------------------------


def holdings(root: str | Path, rank: int, world_size: int, run: str = "") -> list[tuple[int, int]]:
    """(rank r, iteration) of the snapshots this rank can serve from its pod's memory volume: its own, and
    its pod's copies of other ranks; only those whose manifest names r, this world size and this `run`
    (another run's, in a directory two runs share, are left where they are and said once)."""
    foreign: list[str] = []
    out = [(rank, it) for it in _matching(own_dir(root, rank), rank, world_size, run, foreign)]
    with contextlib.suppress(OSError):
        for entry in sorted(Path(root, PEERS).iterdir()):
            r = parse_rank_dir(entry.name)
            if r is not None and r != rank and r < world_size:
                out += [(r, it) for it in _matching(peer_dir(root, r), r, world_size, run, foreign)]
    if foreign:
        log.info("memory snapshots of another run ignored (another job or checkpoint.save): %s%s",
                 ", ".join(foreign[:3]), " ..." if len(foreign) > 3 else "")
    return out[:MAX_HOLDINGS]


def _matching(parent: Path, rank: int, world_size: int, run: str, foreign: list[str]) -> list[int]:
    found = []
    for it in iterations(parent):
        try:
            data = (parent / snap_name(it) / MANIFEST).read_bytes()
            m = parse_manifest(data, str(parent / snap_name(it)))
        except (OSError, CheckpointError):
            continue
        if m.run != run:
            foreign.append(str(parent / snap_name(it)))
        elif m.rank == rank and m.world_size == world_size and m.iteration == it:
            found.append(it)
    return found


@dataclass(frozen=True)
class Agreement:
    """The iteration the gang loads from memory, and for each rank the rank that serves its snapshot."""

    iteration: int
    sources: tuple[int, ...]

    @property
    def loaded_from(self) -> str:
        """`peer` when any rank's snapshot comes from a copy on another pod, else `memory`."""
        return MEMORY if all(q == r for r, q in enumerate(self.sources)) else PEER


def agree(reports: list[list[tuple[int, int]]], world_size: int) -> Agreement | None:
    """The newest iteration every rank of a gang of `world_size` has a source for, given what each rank can
    serve (`reports[q]`: (rank, iteration) pairs): a rank's own snapshot first, else the lowest rank holding
    a copy of it. None when no iteration is covered for every rank. Pure: every rank computes the same."""
    by_iteration: dict[int, dict[int, int]] = {}
    for q, entries in enumerate(reports):
        for r, it in entries:
            if not 0 <= r < world_size:
                continue
            sources = by_iteration.setdefault(it, {})
            current = sources.get(r)
            if current is None or q == r or (current != r and q < current):
                sources[r] = q
    for it in sorted(by_iteration, reverse=True):
        sources = by_iteration[it]
        if len(sources) == world_size:
            return Agreement(it, tuple(sources[r] for r in range(world_size)))
    return None


def why_not(reports: list[list[tuple[int, int]]], world_size: int) -> str:
    """Why `agree` found nothing, in a few words."""
    newest: dict[int, int] = {}
    for entries in reports:
        for r, it in entries:
            newest[r] = max(newest.get(r, -1), it)
    if not newest:
        return "no snapshot in the pods' memory"
    missing = [r for r in range(world_size) if r not in newest]
    if missing:
        return f"no snapshot of rank(s) {', '.join(map(str, missing[:8]))} in any pod's memory"
    return "no iteration whose snapshot every rank has (newest per rank: " + ", ".join(
        f"{r}: {it}" for r, it in sorted(newest.items())[:8]) + ")"


def _encode(entries: list[tuple[int, int]]) -> torch.Tensor:
    flat = [len(entries)] + [x for e in entries for x in e]
    flat += [-1] * (1 + 2 * MAX_HOLDINGS - len(flat))
    return torch.tensor(flat, dtype=torch.int64)


def _decode(t: torch.Tensor) -> list[tuple[int, int]]:
    values = t.tolist()
    n = max(0, min(int(values[0]), MAX_HOLDINGS))
    return [(int(values[1 + 2 * i]), int(values[2 + 2 * i])) for i in range(n)]


def gather_holdings(mine: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Every rank's holdings, on every rank."""
    import torch.distributed as dist

    t = _encode(mine)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    device = comm.collective_device()
    parts = [torch.empty_like(t, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.to(device))
    return [_decode(p.cpu()) for p in parts]


# -- loading ------------------------------------------------------------------------------------------


class GangStore(Store):
    """The agreed snapshot of every rank, as a read-only store holding one sharded checkpoint `name`
    (iter_NNNNNNN): this rank's common.pt and RNG file, every rank's shard index, and the shard files'
    byte ranges, which `read_ranges` fetches from their sources (collective: every rank calls it as
    often, in the same order, as format_sharded's loading does)."""

    is_remote = False

    def __init__(self, agreement: Agreement, rank: int, served: dict[int, OpenSnapshot], small: dict[str, bytes]):
        self.agreement, self.rank, self.served, self.small = agreement, rank, served, small
        self.name = iter_dir(agreement.iteration)
        self.url = f"{agreement.loaded_from}:{snap_name(agreement.iteration)}"

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        if key not in self.small:
            raise FileNotFoundError(f"{self.url}/{key}")
        data = self.small[key]
        if limit is not None and len(data) > limit:
            raise CheckpointError(f"{self.url}/{key} is {len(data)} bytes, more than the {limit} it may hold")
        return data

    def exists(self, key: str) -> bool:
        return key in self.small

    def read_ranges(self, requests: list[tuple[str, int, int]]) -> list[bytes | memoryview]:
        """Collective: each rank's byte ranges of shard files, from the ranks that serve them."""
        shards = {f"{self.name}/{shard_key(r)}": r for r in range(len(self.agreement.sources))}
        mine = []
        for key, start, length in requests:
            if key not in shards:
                raise CheckpointError(f"{self.url}: no shard file {key}")
            mine.append((shards[key], start, length))
        table = _gather_requests(mine)
        sources, me = self.agreement.sources, self.rank
        # what every other rank asked of the ranks this one serves, in its order, read straight into one send buffer;
        # its own asks are views of its mapped files (never through the exchange: no copy, no buffer)
        parts = [[(r, s, n) for r, s, n in wanted if sources[r] == me] if q != me else []
                 for q, wanted in enumerate(table)]
        sizes = [sum(n for _, _, n in p) for p in parts]
        send = torch.empty(sum(sizes), dtype=torch.uint8)
        view, at = memoryview(send.numpy()), 0  # type: ignore[arg-type]  # (numpy's stubs: no Buffer)
        for r, s, n in (part for p in parts for part in p):
            self.served[r].read_into(shard_key(r), s, view[at:at + n])
            at += n
        world = len(sources)
        got = [memoryview(t.numpy()) for t in comm.exchange_bytes(  # type: ignore[arg-type]  # (numpy's stubs)
            send, sizes, [sum(n for r, _, n in mine if sources[r] == q) if q != me else 0 for q in range(world)])]
        offsets = [0] * world
        out: list[bytes | memoryview] = []
        for r, s, n in mine:  # views of the received buffers and mapped files, not copies (format_sharded cuts once)
            q = sources[r]
            if q == me:
                out.append(self.served[r].mapped(shard_key(r), s, n))
                continue
            out.append(got[q][offsets[q]:offsets[q] + n])
            offsets[q] += n
        return out

    def close(self) -> None:
        for snap in self.served.values():
            snap.close()

    # a read-only view: nothing else of a store is asked of it
    def open_write(self, key: str):
        raise CheckpointError(f"{self.url} is read-only")

    def open_read(self, key: str):
        raise CheckpointError(f"{self.url}: read through read_ranges")

    def list(self, prefix: str = "") -> builtins.list[str]:
        return sorted(k for k in self.small if k.startswith(prefix))

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        return [self.name] if not prefix else []

    def delete_prefix(self, prefix: str) -> None:
        raise CheckpointError(f"{self.url} is read-only")

    def append_line(self, key: str, line: str) -> None:
        raise CheckpointError(f"{self.url} is read-only")

    def begin_dir(self, name: str, *, txn_id: str | None = None, primary: bool | None = None):
        raise CheckpointError(f"{self.url} is read-only")

    def cleanup_partial(self, *, min_age_s: float = 0.0) -> builtins.list[str]:
        return []


def _gather_requests(mine: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    flat = json.dumps(mine).encode()
    return [[(int(r), int(s), int(n)) for r, s, n in json.loads(b)] for b in comm.all_gather_bytes(flat)]


@dataclass
class Recovered:
    """What `open_gang` found: the store to restore from, or None and why not (`failed`: a snapshot the gang
    agreed on failed its checks: torn, corrupted, unreadable)."""

    store: GangStore | None
    reason: str
    failed: bool = False


@dataclass(frozen=True)
class Recovery:
    """How a run resumed (rank 0 reports it: status.lastRecovery): from `loaded_from` (MEMORY, PEER, STORE) at
    `iteration` in `seconds`; `reason`: why not from memory; `failed`: a snapshot failed its checks."""

    loaded_from: str
    iteration: int | None
    seconds: float
    reason: str
    failed: bool

    def report(self, restart: int) -> TrainerRecovery | None:
        """As rank 0's status endpoint serves it (`restart`: the in-place restart it followed); None before a
        resume, and for a first start afresh (iteration 0, no restart, no snapshot that failed its checks). A
        start afresh after a restart or a failed snapshot is reported (from the store, at iteration 0): the user
        sees that the recovery found nothing to load, and why not from memory."""
        if self.iteration is None or (self.iteration == 0 and not restart and not self.failed):
            return None
        return TrainerRecovery(loadedFrom=self.loaded_from, iteration=self.iteration, seconds=round(self.seconds, 3),
                               reason=self.reason, failed=self.failed, restart=restart)


def open_gang(root: str | Path, rank: int, world_size: int, newer_than: int | None, run: str = "") -> Recovered:
    """Collective: the snapshot every rank agrees on, opened and checked, as a GangStore; or None and the
    reason (nothing agreed, not newer than `newer_than` (the store's newest, or what the operator expects),
    a snapshot that fails its checks on some rank)."""
    reports = gather_holdings(holdings(root, rank, world_size, run))
    agreement = agree(reports, world_size)
    if agreement is None:
        return Recovered(None, why_not(reports, world_size))
    if newer_than is not None and agreement.iteration < newer_than:
        return Recovered(None, f"the snapshots' iteration {agreement.iteration} is older than the store's "
                               f"{newer_than}")
    served: dict[int, OpenSnapshot] = {}
    error = ""
    try:
        for r, q in enumerate(agreement.sources):
            if q == rank:
                path = (own_dir(root, r) if r == rank else peer_dir(root, r)) / snap_name(agreement.iteration)
                served[r] = OpenSnapshot(path, rank=r, world_size=world_size)
                served[r].verify()
    except CheckpointError as e:
        error = f"rank {rank}: {e}"
    errors = [e.decode() for e in comm.all_gather_bytes(error.encode()) if e]
    if errors:
        for snap in served.values():
            snap.close()
        return Recovered(None, errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""), True)
    small = _small_files(agreement, rank, served)
    return Recovered(GangStore(agreement, rank, served, small), "")


def _small_files(agreement: Agreement, rank: int, served: dict[int, OpenSnapshot]) -> dict[str, bytes]:
    """Every rank's index, this rank's common state and RNG (all-gathered from their sources), by the keys a
    sharded checkpoint gives them."""
    name = iter_dir(agreement.iteration)
    mine = {}
    for r, snap in served.items():
        mine[f"{name}/{index_key(r)}"] = snap.read_all(index_key(r), MAX_INDEX)
        mine[f"{name}/{COMMON}@{r}"] = snap.read_all(COMMON_FILE, MAX_INDEX)
        mine[f"{name}/{rng_file(r)}"] = snap.read_all(RNG_FILE, MAX_SMALL)
    small: dict[str, bytes] = {}
    own_common = f"{name}/{COMMON}@{rank}"
    for payload in comm.all_gather_bytes(_frame(mine)):
        for key, data in _unframe(payload).items():
            if key == own_common:
                small[f"{name}/{COMMON}"] = data
            elif key.endswith(".json") or key == f"{name}/{rng_file(rank)}":
                small[key] = data
    return small


def _frame(files: dict[str, bytes]) -> bytes:
    """Named byte strings as one: an 8-byte header length, a JSON header {name: [offset, length]}, the bytes."""
    header, at = {}, 0
    for key, data in files.items():
        header[key] = [at, len(data)]
        at += len(data)
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "big") + head + b"".join(files.values())


def _unframe(payload: bytes) -> dict[str, bytes]:
    n = int.from_bytes(payload[:8], "big")
    header = json.loads(payload[8:8 + n])
    blob = memoryview(payload)[8 + n:]
    return {key: bytes(blob[at:at + length]) for key, (at, length) in header.items()}
