"""Memory snapshots, the saving side (docs/recovery.md): every rank writes its shard of the whole training
state into the pod's memory volume (`checkpoint.non_persistent_ckpt_type: local`), in the background.

What a rank writes is exactly its part of a sharded checkpoint (format_sharded's pieces: 1/world of the
replicated tensors, its own ranges of a distributed optimizer) plus the counters, scheduler, data position
and param groups (`common.pt`) and its RNG states, as kubetron.storage.snapshot_files lays them out. The loop
blocks only for the copy into host buffers, the copy an async durable save makes: when a durable save is taken at
the same iteration, the snapshot is written from that very copy (kubetron.checkpoint.manager).

When: every `checkpoint.non_persistent_save_interval` iterations, or by default as often as costs at most
BUDGET of the step time: the first FIRST_AFTER iterations after the start, then each ceil(cost / (BUDGET x step
time)) iterations after the one before, where cost is the newest snapshot's (the loop's blocked time, plus, on
CPU where the background write competes for the same cores, the write's own time), the largest over the ranks,
re-read once that snapshot is measured: so the first one's unknown cost never makes the second follow it at once.
The default schedule counts the iterations this process ran (one `due()` call each), not iteration numbers, so a
loop that shares its counter with other work (bench/loop_overhead.py's interleaved variants) pays what a run
pays. All ranks snapshot at the same iterations (a collective decides at each due step); a write still running on
any rank postpones the next.
So does a snapshot not yet sent to the pods that hold its copies (where the pod's agent copies them,
`paced`; for at most COPY_PATIENCE): a pod keeps only KEEP snapshots of a rank, and the gang can
load only an iteration every rank has, its own or a copy, so the copies must not fall behind.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from kubetron.checkpoint import comm, format_sharded
from kubetron.checkpoint.hostcopy import HostBuffers
from kubetron.storage.snapshot_files import (
    COMMON_FILE,
    RNG_FILE,
    Manifest,
    SnapshotWriter,
    copied,
    drop_newer,
    own_dir,
    remove_partial,
    run_identity,
    snap_name,
    write_snapshot,
)

log = logging.getLogger("kubetron")

BUDGET = 0.02  # of the step time, what the default interval lets snapshots cost
FIRST_AFTER = 2  # iterations after the start before the first snapshot (the step time is known by then)
COPY_PATIENCE = 60.0  # seconds a snapshot waits for its copies before the next is taken regardless


class MemorySnapshots:
    """One rank's snapshots in `root` (its own directory there) and when to take them; owned by the
    CheckpointManager, which hands it the host copy (`take`)."""

    def __init__(self, root: str | Path, rank: int, world_size: int, interval: int | None,
                 count_background: bool, paced: bool = False, run: str = ""):
        self.root, self.rank, self.world_size = Path(root), rank, world_size
        self.run = run  # snapshot_files.run_identity: written into each manifest; a resume loads only its own
        self.interval = interval  # None: the time-based default
        self.count_background = count_background  # the write competes with training (CPU): it is a cost too
        self.paced = paced  # the next snapshot waits for the copies of the last (the pod's agent marks them)
        self._written_at = 0.0  # time.monotonic() of the newest write's end
        self.dir = own_dir(root, rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        remove_partial(self.dir)  # what a killed writer left (this rank is its directory's only writer)
        self.buffers = HostBuffers()  # the host copy when no durable save shares its own
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kubetron-snapshot")
        self._pending: Future | None = None
        self._since: int | None = None  # the default schedule: iterations since the last snapshot (or the start)
        self._every = FIRST_AFTER  # ... after which one may be due (re-read from the newest cost when reached)
        self._last_tick: float | None = None
        self._step_times: deque[float] = deque(maxlen=20)  # seconds between the loop's iterations
        self.blocked = 0.0  # the newest snapshot's copy (seconds the loop waited)
        self.write_seconds = 0.0  # the newest finished write's time in the background
        self.written: int | None = None  # the newest iteration written here by this process
        self.taken = 0  # snapshots taken by this process

    # -- when -----------------------------------------------------------------------------------------
    def resumed(self, iteration: int) -> None:
        """The run continues after `iteration`: snapshots of this rank newer than it are of iterations that
        will be computed again (a fallback to an older checkpoint): dropped, so they never outrank those."""
        drop_newer(self.dir, iteration)
        self._since, self._every = 0, FIRST_AFTER

    def due(self, step: int) -> bool:
        """Whether to snapshot after iteration `step`; collective at the iterations where one may be due (the
        same on every rank): none is taken while any rank's previous write still runs."""
        now = time.perf_counter()
        if self._last_tick is not None:
            self._step_times.append(now - self._last_tick)
        self._last_tick = now
        since = 0
        if self.interval:
            if step % self.interval:
                return False
        else:
            if self._since is None:  # not resumed yet
                return False
            since = self._since = self._since + 1
            if since < self._every:
                return False
        busy = self._pending is not None and not self._pending.done() or self._copies_lag()
        step_time = statistics.median(self._step_times) if self._step_times else 0.0
        cost = self.blocked + (self.write_seconds if self.count_background else 0.0)
        busy_any, cost, step_time = _max_over_ranks([float(busy), cost, step_time])
        if busy_any:
            log.debug("snapshot at iteration %d postponed: the previous one is still being written", step)
            return False
        if not self.interval:
            if self.taken:  # the newest snapshot's cost is known (a write still running was waited for above)
                every = max(1, math.ceil(cost / (BUDGET * step_time))) if cost and step_time else 1
                if since < every:
                    self._every = every
                    return False
            self._since, self._every = 0, 1  # the next is re-read once this one is measured
        return True

    def _copies_lag(self) -> bool:
        """The newest snapshot written is not yet on the pods that hold its copies (and not for long)."""
        if not self.paced or self.written is None or time.monotonic() - self._written_at > COPY_PATIENCE:
            return False
        return (copied(self.dir) or -1) < self.written

    # -- writing --------------------------------------------------------------------------------------
    def take(self, iteration: int, shard: format_sharded.RankShard, common: bytes, rng: bytes,
             copied: torch.cuda.Event | None, blocked: float, on_written: Callable[[], None] | None = None) -> None:
        """Write this rank's snapshot of `iteration` in the background from the host copy `shard` (its
        buffers must stay untouched until `wait()` returns)."""
        self.wait()  # (due() made sure it is done)
        self.blocked = blocked
        self.taken += 1
        self._pending = self._pool.submit(self._write, iteration, shard, common, rng, copied, on_written)

    def _write(self, iteration, shard, common: bytes, rng: bytes, copied, on_written) -> None:
        t0 = time.perf_counter()
        if copied is not None:
            copied.synchronize()  # the device->host copies were only queued

        def files(w: SnapshotWriter) -> None:
            format_sharded.write(w, self.rank, shard)
            w.write_bytes(COMMON_FILE, common)
            w.write_bytes(RNG_FILE, rng)

        def manifest(written: dict) -> Manifest:
            return Manifest(iteration, self.rank, self.world_size, written, self.run)

        write_snapshot(self.dir, manifest, files, iteration)
        self.written, self._written_at = iteration, time.monotonic()
        self.write_seconds = time.perf_counter() - t0
        log.debug("snapshot %s written to %s (%.3fs)", snap_name(iteration), self.dir, self.write_seconds)
        if on_written is not None:
            on_written()

    def wait(self) -> None:
        """Until the write in flight (if any) is done; its error, if it failed, is logged (a snapshot that
        cannot be written costs recovery speed, never the run)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as e:  # noqa: BLE001 - a full memory volume, say: the store still has the checkpoints
            log.warning("memory snapshot not written: %s: %s", type(e).__name__, e)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


def _max_over_ranks(values: list[float]) -> list[float]:
    """The element-wise maximum over all ranks (one small all-reduce)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=comm.collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def open_snapshots(cfg, rank: int, world_size: int, paced: bool = False, job: str = "") -> MemorySnapshots | None:
    """This rank's MemorySnapshots when the run takes them (checkpoint.non_persistent_ckpt_type local, and its
    directory: the config's, else the pod's memory volume, which resolve() fills in), else None. `paced`: each
    waits for the copies of the last (the pod's agent copies them). `job`: the job (`<namespace>/<job>`, "" outside
    one), which with checkpoint.save names the run its snapshots belong to."""
    ck = cfg.checkpoint
    if ck.non_persistent_ckpt_type != "local" or not ck.non_persistent_local_ckpt_dir:
        return None
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    return MemorySnapshots(ck.non_persistent_local_ckpt_dir, rank, world_size, ck.non_persistent_save_interval,
                           count_background=not on_gpu, paced=paced, run=run_identity(job, str(ck.save or "")))
