"""CheckpointManager: what the loop calls to save and to restore a run, over the layers below it
(layout.py, hostcopy.py, canonical.py, one format_*.py per ckpt_format; see kubetron/checkpoint/__init__.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kubetron.checkpoint import adapters, comm, format_kubetron, format_sharded, format_torch_dist, gang
from kubetron.checkpoint.canonical import (
    load_optimizer_state_by_name,
    load_owned_optimizer_state,
    optimizer_state_by_name,
)
from kubetron.checkpoint.comm import any_rank
from kubetron.checkpoint.hostcopy import HostBuffers
from kubetron.checkpoint.layout import (
    CHECKPOINT_VERSION,
    COMMON,
    MARKER,
    MAX_INDEX,
    MAX_SMALL,
    NON_PERSISTENT,
    RUN_CONFIG,
    TOKENIZER_DIR,
    TRACKER,
    arch_record,
    bridge_heads,
    check_architecture,
    check_version,
    committed_iterations,
    iter_dir,
    log_run_config_changes,
    read_json,
    read_tokenizer_assets,
    resolve_checkpoint,
    rng_file,
    safe_load,
    to_bytes,
    tokenizer_vocab,
)
from kubetron.checkpoint.rng import get_rng_state, set_rng_state
from kubetron.checkpoint.snapshot import MemorySnapshots, open_snapshots
from kubetron.contract import exitcodes
from kubetron.contract.errors import CheckpointError, ConfigError, ResumeMismatchError
from kubetron.contract.hang import CHECKPOINT
from kubetron.contract.recovery import MEMORY, STORE
from kubetron.contract.times import stamp
from kubetron.events import PROGRESS, Checkpoint, CheckpointDurable, Events, SaveScheduled, SnapshotWritten
from kubetron.storage import open_store

log = logging.getLogger("kubetron")


SAVE_POINTS = ("after-shard", "after-model", "after-optim", "after-common", "after-payload", "after-commit",
               "after-tracker")
"""The points of a save where the manager calls its `faults` hook, in the order a save passes them: a rank's
sharded part written; rank 0's model and optimizer files (kubetron format) and common state written; every file
of the rank written (the payload); the commit marker written; the tracker moved (rank 0)."""

SaveFaults = Callable[[str, int], None]
"""(point, iteration) -> None, called at each of SAVE_POINTS: where tests and `KUBETRON_CHAOS_KILL_AT` stop a save
(the CLI installs that one; a process-tier test SIGKILLs the trainer there, an in-process test raises)."""


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class Snapshot:
    """Host-memory copy of everything a checkpoint holds (what an async save blocks for)."""

    iteration: int
    model: dict | None  # kubetron format: canonical tensors (rank 0 only)
    optim: dict | None
    shard: format_sharded.RankShard | None  # sharded format: this rank's pieces
    common: dict | None
    rng: dict
    run_config: str | None
    taken: float = 0.0  # wall time (time.time()) of the snapshot
    train_state: dict | None = None  # the counters as of the snapshot
    tokenizer: dict | None = None  # {file name: bytes} of a file-based tokenizer (rank 0 only)
    copied: torch.cuda.Event | None = None  # CUDA: an event after the device→host copies (then the buffers are valid)


LoadHF = Callable[[list, Any, str, Callable[[str], bool] | None], dict | None]
"""(model, cfg, path, keep) -> the HF base's record, once the weights of the Hugging Face model directory
`path` are in the model chunks (only the tensors whose names `keep` accepts; None: all); None when `path`
is not a Hugging Face model directory."""


def time_limit_reached(cfg, start_time: float) -> bool:
    """train.exit_duration_in_mins has passed since `start_time` on any rank (collective when it is set)."""
    limit = cfg.train.exit_duration_in_mins
    return bool(limit) and any_rank((time.time() - start_time) / 60.0 > limit)


def open_save_store(cfg):
    """The store checkpoint.save names (None: saving off)."""
    ck = cfg.checkpoint
    return open_store(ck.save, endpoint_url=ck.s3_endpoint_url, region=ck.s3_region) if ck.save else None


class CheckpointManager:
    """Saves and restores a run, and decides when: the loop calls `after_step(step)` once per iteration
    and `finish(step)` after the last; a run starts with `load()`.

    It is handed the parts a checkpoint holds and restores them in place (it never replaces an object
    someone else holds): the model chunks, the optimizer, and what has `state_dict()`/`load_state_dict()`:
    the LR scheduler, the train state (counters) and the data iterators. It owns the host buffers
    snapshots are copied into, and the save/exit schedule (checkpoint.save_interval,
    non_persistent_save_interval, a signal, train.exit_duration_in_mins, train.exit_interval, a straggler).
    What it does goes to `events` (kubetron.events: a save's phase and progress, a checkpoint durable); `faults`
    is called at each of SAVE_POINTS of a save; `paced_snapshots`: memory snapshots wait for their copies on
    peers (the pod's agent copies them: checkpoint/snapshot.py); `job`: the job (`<namespace>/<job>`) that with
    checkpoint.save names the run the snapshots belong to.
    """

    def __init__(self, cfg, store, *, model, optimizer, scheduler, train_state, data=(None, None), run_id: str,
                 world_size: int | None = None, signal_handler=None, start_time: float | None = None,
                 load_hf: LoadHF | None = None, events: Events | None = None, faults: SaveFaults | None = None,
                 paced_snapshots: bool = False, job: str = ""):
        self.cfg, self.save_store = cfg, store
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data
        self.train_state = train_state
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if dist.is_initialized() else 1)
        self.run_id = run_id  # same on all ranks: names the save transaction
        self.signal_handler = signal_handler  # SIGTERM/SIGINT: save and stop (train.exit_signal_handler)
        self.start_time = time.time() if start_time is None else start_time  # train.exit_duration_in_mins
        self.load_hf = load_hf  # pretrained_checkpoint as a Hugging Face directory (kubetron.training.first_weights)
        self.events = events if events is not None else Events()
        self.faults = faults
        self.buffers = HostBuffers()
        self._plan: dict = {}  # format_sharded.snapshot's cuts, worked out at the first save (the layout is fixed)
        ck = cfg.checkpoint
        # non-persistent "local": snapshots in the pod's memory (checkpoint/snapshot.py, docs/recovery.md)
        self.memory: MemorySnapshots | None = open_snapshots(cfg, _rank(), self.world_size,
                                                                    paced=paced_snapshots, job=job)
        self.recovery: gang.Recovery | None = None  # how load() resumed (status.lastRecovery)
        self._newest: Snapshot | None = None  # the newest durable save's host copy (a snapshot of its step reuses it)
        self.async_saver = None
        if ck.async_save and store is not None:
            from kubetron.storage import AsyncSaver

            self.async_saver = AsyncSaver()
        if store is not None and _rank() == 0:
            removed = store.cleanup_partial()  # what a killed save left behind
            if removed:
                log.info("removed %d partial checkpoint entries left by an interrupted save", len(removed))
        if store is not None:
            _barrier()  # no rank starts a save (a multipart upload) while rank 0 still cleans up
        self.last_durable: int | None = None
        self.last_durable_time: str | None = None
        self.last_save_bytes = 0  # bytes this rank wrote in its newest save (tensor payload)
        self._blocked: dict[int, float] = {}  # iteration -> seconds the loop waited, until that save is durable
        self._run_config_yaml: str | None = None
        self._tokenizer_assets: dict[str, bytes] | None = None
        self.hf_record: dict | None = None  # the HF base's special ids + generation config (kubetron.hf.generation)

    @property
    def enabled(self) -> bool:
        return self.save_store is not None

    def time_limit_reached(self) -> bool:
        """train.exit_duration_in_mins has passed since this process started, on any rank (collective when set)."""
        return time_limit_reached(self.cfg, self.start_time)

    # -- the schedule: when to save, when to stop ------------------------------------------------------
    def after_step(self, step: int, *, straggler: bool = False) -> int | None:
        """After iteration `step` (the loop calls this once per iteration): finish the async saves that are
        done, save when the schedule says so, and return the exit code when the run stops here (None: go
        on). `straggler`: the straggler detector asks to stop (saved, then exitcodes.STRAGGLER)."""
        if straggler:  # straggler.stop_if_detected
            self.save(step, blocking=True)
            return exitcodes.STRAGGLER
        self.finalize(blocking=False)  # async saves that are done become durable
        cfg = self.cfg
        handler = self.signal_handler
        if any_rank(handler is not None and handler.received is not None) and step < cfg.train.train_iters:
            self.save(step, blocking=True)  # at the last iteration: completed, saved as such (0)
            log.info("received %s: saved at iteration %d, exiting",
                     (handler.signal_name if handler is not None else "") or "a signal on another rank", step)
            return exitcodes.SAVED_ON_SIGNAL
        saved = False
        if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
            self.save(step)
            saved = True
        elif cfg.checkpoint.non_persistent_save_interval and step % cfg.checkpoint.non_persistent_save_interval == 0 \
                and self.memory is None:
            self.save(step, non_persistent=True)
        if self.memory is not None and self.memory.due(step):
            self._save_memory(step, shared=saved)
        if self.time_limit_reached():
            if not saved:
                self.save(step, blocking=True)
            log.info("exit_duration_in_mins (%.1f) reached at iteration %d", cfg.train.exit_duration_in_mins, step)
            return exitcodes.EXIT_CONDITION
        if cfg.train.exit_interval and step % cfg.train.exit_interval == 0 and step < cfg.train.train_iters:
            if not saved:
                self.save(step, blocking=True)
            log.info("exit_interval (%d) reached at iteration %d", cfg.train.exit_interval, step)
            return exitcodes.EXIT_CONDITION
        return None

    def finish(self, step: int) -> int:
        """After the last iteration: make sure it is durable, and wait for every async save.
        Returns exitcodes.COMPLETED."""
        if self.enabled and self.last_durable != step:
            self.save(step, blocking=True)
        self.finalize(blocking=True)
        return exitcodes.COMPLETED

    def _run_config(self) -> str:
        """run_config.yaml: the resolved config, rendered once (it does not change during a run)."""
        if self._run_config_yaml is None:
            self._run_config_yaml = self.cfg.to_yaml()
        return self._run_config_yaml

    def _tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer's files, read once (Bridge's save_tokenizer_assets)."""
        if self._tokenizer_assets is None:
            from kubetron.data.tokenizer import tokenizer_assets

            self._tokenizer_assets = tokenizer_assets(self.cfg)
        return self._tokenizer_assets

    # -- saving ---------------------------------------------------------------------------------------
    def snapshot(self, iteration: int, buffers: HostBuffers | None = None) -> Snapshot:
        """Copy what this rank saves to host memory (the only part of an async save that blocks; on CUDA
        the copies are only queued). sharded: this rank's own pieces; kubetron: full tensors gathered
        onto rank 0. The CPU copies of the sharded pieces run last, together (HostBuffers.batch).
        `buffers`: where to (default: the durable saves' own)."""
        buffers = self.buffers if buffers is None else buffers
        with buffers.batch():
            return self._snapshot(iteration, buffers)

    def _snapshot(self, iteration: int, buffers: HostBuffers) -> Snapshot:
        fmt, ck = self.cfg.checkpoint.ckpt_format, self.cfg.checkpoint
        self.optimizer.finish_param_sync()  # weights still being all-gathered (ddp.overlap_param_gather)
        model_sd = optim_sd = shard = None
        # a DP-sharded optimizer's own ranges go straight into the sharded format (no gather)
        owned = self.optimizer.owned_state() if ck.save_optim and fmt == "sharded" else None
        by_name = optimizer_state_by_name(self.model, self.optimizer, with_state=owned is None) \
            if ck.save_optim and fmt != "torch_dist" else None
        if fmt == "sharded":
            keep = adapters.is_adapter_name if adapters.enabled(self.cfg) else None
            shard = format_sharded.snapshot(self.model, by_name["state"] if by_name else None,
                                            buffers, keep=keep, owned=owned, plan=self._plan)
        elif fmt == "kubetron":  # (torch_dist: every rank writes in write())
            model_sd, optim_sd = format_kubetron.snapshot(self.model, by_name, self.buffers)
        rank0 = _rank() == 0
        common = self._common_state(iteration, by_name) if rank0 or self.memory is not None else None
        copied = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # The device→host copies are queued on the current stream (pinned buffers, non-blocking): the
            # loop goes on at once, and anything that later changes the weights is queued behind them.
            # The writer waits for this event before it reads the buffers.
            copied = torch.cuda.Event()
            copied.record()
        return Snapshot(
            iteration=iteration,
            model=model_sd if rank0 else None,
            optim=optim_sd if rank0 else None,
            shard=shard,
            common=common,
            rng=get_rng_state() if ck.save_rng else {},
            run_config=self._run_config() if rank0 else None,
            taken=time.time(),
            train_state=self.train_state.state_dict(),
            tokenizer=self._tokenizer_files() if rank0 else None,
            copied=copied,
        )

    def save(self, step: int, *, non_persistent: bool = False, blocking: bool | None = None):
        """Save iteration `step` (the loop's train_state.step). Async saves return after the snapshot."""
        if not self.enabled:
            return
        with self.events.phase(CHECKPOINT):  # a slow save is not a hang (docs/recovery.md)
            self._save(step, non_persistent, blocking)

    def _save(self, step: int, non_persistent: bool, blocking: bool | None):
        t0 = time.perf_counter()
        self.finalize(blocking=True)  # one save in flight at a time
        if self.memory is not None:
            self.memory.wait()  # a snapshot written from the previous save's host copy
        snap = self._newest = self.snapshot(step)
        name = (f"{NON_PERSISTENT}/" if non_persistent else "") + iter_dir(step)
        saver = None if blocking else self.async_saver
        use_async = saver is not None
        holder: dict[str, Any] = {}  # the transaction is opened in write(): on S3 that is a few requests, off the loop
        write = lambda: self._write(name, snap, holder)  # noqa: E731
        finalize = lambda: self._commit(name, snap, holder, non_persistent, use_async, t0)  # noqa: E731
        if saver is not None:
            saver.schedule(write, finalize)
            blocked = time.perf_counter() - t0
            if not non_persistent:
                self._blocked[step] = blocked
            log.info("async save of %s scheduled; the loop was blocked %.3fs", name, blocked)
            self.events.emit(SaveScheduled(step))
            return
        try:
            write()
        except Exception:
            if "txn" in holder:
                holder["txn"].abort()
            raise
        finalize()

    def _write(self, name: str, snap: Snapshot, holder: dict):
        """Every rank: its own files into the transaction (background thread for async saves)."""
        rank, it = _rank(), snap.iteration
        def wrote():  # each file written is progress: a slow store is not a hang
            self.events.emit(PROGRESS)

        if snap.copied is not None:
            snap.copied.synchronize()
        txn = holder["txn"] = self.save_store.begin_dir(name, txn_id=f"{self.run_id}-{it}")
        if snap.rng:  # checkpoint.save_rng: false writes none (and a resume keeps this run's seeds)
            txn.write_bytes(rng_file(rank), to_bytes(snap.rng))
            wrote()
        if snap.shard is not None:
            self.last_save_bytes = format_sharded.write(txn, rank, snap.shard,
                                                        after_data=lambda: self._fault("after-shard", it))
            wrote()
        if self.cfg.checkpoint.ckpt_format == "torch_dist":  # collective; sync saves only (config)
            common = format_torch_dist.megatron_common(it, self.scheduler.state_dict(),
                                                       self.train_state.state_dict())
            facts = format_torch_dist.save(self.model, self.optimizer, txn, self.cfg,
                                           with_optimizer=self.cfg.checkpoint.save_optim, common=common)
            if snap.common is not None and facts:
                snap.common["dist_optimizer"] = facts
        if snap.common is not None and rank == 0:
            format_kubetron.write(txn, snap.model, snap.optim, after=lambda key: self._fault(f"after-{key[:-3]}", it))
            wrote()
            with txn.open_write(COMMON) as f:
                torch.save(snap.common, f)
            wrote()
            self._fault("after-common", it)
            assert snap.run_config is not None  # (rank 0's snapshot, like common)
            txn.write_bytes(RUN_CONFIG, snap.run_config.encode())
            for file_name, data in (snap.tokenizer or {}).items():  # a checkpoint is self-contained
                txn.write_bytes(f"{TOKENIZER_DIR}/{file_name}", data)
        self._fault("after-payload", it)

    def _fault(self, point: str, iteration: int) -> None:
        if self.faults is not None:
            self.faults(point, iteration)

    def _commit(self, name: str, snap: Snapshot, holder: dict, non_persistent: bool, use_async: bool, t0: float):
        """Collective: once every rank's files are durable, rank 0 writes the marker, then the tracker."""
        _barrier()  # every rank's files are written
        txn = holder["txn"]
        if self.save_store.is_remote:  # what this save wrote, on every rank: the rest of the directory goes (S3)
            written = comm.all_gather_bytes("\n".join(txn.written).encode())
        if _rank() == 0:
            marker = {"iteration": snap.iteration, "time": stamp(), "run_id": self.run_id,
                      "checkpoint_version": CHECKPOINT_VERSION, "world_size": self.world_size}
            if self.save_store.is_remote:
                stale = txn.sweep({key for keys in written for key in keys.decode().split("\n") if key})
                if stale:
                    log.info("removed %d files an older copy of %s left", len(stale), name)
            txn.commit(json.dumps(marker).encode())
            self._fault("after-commit", snap.iteration)
            if not non_persistent:
                assert snap.common is not None  # (rank 0's snapshot)
                tracker = {"iteration": snap.iteration, "train_state": snap.common["train_state"],
                           "time": marker["time"]}
                self.save_store.replace_tracker(TRACKER, to_bytes(tracker))
                self._fault("after-tracker", snap.iteration)
                self._apply_retention()
            else:
                self._cleanup_non_persistent(keep=name)
        _barrier()
        seconds = time.perf_counter() - t0
        log.info("saved checkpoint %s at iteration %d (%.2fs)", name, snap.iteration, seconds)
        if not non_persistent:
            self.last_durable, self.last_durable_time = snap.iteration, stamp()
            blocked = self._blocked.pop(snap.iteration, seconds)  # a sync save: all of it
            assert snap.train_state is not None
            self.events.emit(CheckpointDurable(Checkpoint(snap.iteration, self.last_durable_time), snap.taken,
                                               snap.train_state, seconds, blocked, use_async))

    def finalize(self, blocking: bool = False):
        """Finish async saves that are done (or all, if blocking). Collective when world_size > 1:
        a save is finalized only once every rank's background write has finished."""
        saver = self.async_saver
        if saver is None or not saver.pending:  # the same on every rank: saves start and end together,
            return  # so the loop pays the collective below only while a save is in flight
        if blocking or not (dist.is_initialized() and dist.get_world_size() > 1):
            with self.events.phase(CHECKPOINT):
                saver.maybe_finalize(blocking=blocking)
            return
        if comm.all_ranks(saver.ready()):
            with self.events.phase(CHECKPOINT):
                saver.maybe_finalize(blocking=True)

    def close(self):
        if self.memory is not None:
            self.memory.close()
        if self.async_saver is not None:
            self.async_saver.maybe_finalize(blocking=True)
            self.async_saver.close()
            self.async_saver = None

    def _common_state(self, iteration: int, by_name: dict | None) -> dict:
        ts, fmt = self.train_state, self.cfg.checkpoint.ckpt_format
        train_it, valid_it = self.data
        common = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "train_state": ts.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": {"train": train_it.state_dict() if train_it is not None else None,
                     "valid": valid_it.state_dict() if valid_it is not None else None},
            "model_config": arch_record(self.cfg.model),
            "tokenizer_vocab_size": tokenizer_vocab(self.cfg),
            "parallel": {"world_size": self.world_size, "tp": self.cfg.model.tensor_model_parallel_size,
                         "pp": self.cfg.model.pipeline_model_parallel_size, "dp": self.cfg.data_parallel_size},
            "ckpt_format": fmt,
        }
        if adapters.enabled(self.cfg):  # adapter-only: the base is the pretrained checkpoint's
            common["peft"] = adapters.checkpoint_info(self.cfg)
        if self.hf_record:  # carried from the pretrained checkpoint to export-hf
            common["hf"] = self.hf_record
        if self.optimizer.loss_scaler is not None:  # fp16: a resume continues with the same scale
            common["loss_scaler"] = self.optimizer.loss_scaler.state_dict()
        if fmt == "sharded":
            common["num_shards"] = self.world_size
            common["optim_param_groups"] = by_name["param_groups"] if by_name else None
        return common

    # -- non-persistent "local": snapshots in the pods' memory ------------------------------------------
    def _save_memory(self, step: int, shared: bool):
        """This rank's snapshot of `step`, written in the background; from the durable save's host copy when
        one was taken at this iteration (else a copy of its own: the loop waits as long as for an async save)."""
        assert self.memory is not None
        t0 = time.perf_counter()
        snap = self._newest if shared and self._newest is not None and self._newest.iteration == step else None
        if snap is None:
            with self.events.phase(CHECKPOINT):
                snap = self.snapshot(step, self.memory.buffers)
        assert snap.shard is not None and snap.common is not None  # (sharded, memory on: every rank's)
        memory = self.memory
        memory.take(step, snap.shard, to_bytes(snap.common), to_bytes(snap.rng), snap.copied,
                    blocked=time.perf_counter() - t0,
                    on_written=lambda: self.events.emit(SnapshotWritten(step, memory.write_seconds)))

    def _resume_from_memory(self, found, expected: int | None) -> int | None:
        """Collective: resume from the newest snapshot every rank can load from the pods' memory (their own or
        a peer's copy; checkpoint/gang.py), when it is not older than the store's newest checkpoint nor than
        what the operator expects. None: the store, and the reason is logged."""
        assert self.memory is not None
        t0 = time.perf_counter()
        floor = max(found[2] if found else 0, expected or 0)
        got = gang.open_gang(self.memory.root, _rank(), self.world_size, newer_than=floor or None,
                             run=self.memory.run)
        if got.store is None:
            self.recovery = gang.Recovery(STORE, None, 0.0, got.reason, got.failed)
            log.info("resuming from the store, not from memory: %s", got.reason)
            return None
        with got.store:
            self._restore(got.store, got.store.name, full=True)
        iteration, seconds = got.store.agreement.iteration, time.perf_counter() - t0
        self.recovery = gang.Recovery(got.store.agreement.loaded_from, iteration, seconds, "", False)
        log.info("resumed from the memory snapshot at iteration %d (%s, %.2fs)", iteration,
                 "every rank from its own pod" if self.recovery.loaded_from == MEMORY
                 else "ranks " + ", ".join(str(r) for r, q in enumerate(got.store.agreement.sources) if q != r)
                 + " from copies on other pods", seconds)
        return iteration

    def _restore_common(self, common):
        """Train state and data positions; the LR scheduler and fp16 loss scale only with the optimizer
        state (checkpoint.load_optim), as Megatron: without it they start afresh."""
        if self.cfg.checkpoint.load_optim:
            self.scheduler.load_state_dict(common["scheduler"])
            if self.optimizer.loss_scaler is not None and common.get("loss_scaler"):
                self.optimizer.loss_scaler.load_state_dict(common["loss_scaler"])
        self.train_state.load_state_dict(common["train_state"])
        train_it, valid_it = self.data
        data = common.get("data", {})
        if train_it is not None and data.get("train"):
            train_it.load_state_dict(data["train"])
        if valid_it is not None and data.get("valid"):
            valid_it.load_state_dict(data["valid"])

    def _apply_retention(self):
        k = self.cfg.checkpoint.most_recent_k
        if k is None or k < 1:
            return
        durable = committed_iterations(self.save_store)
        for it in durable[:-k]:  # newest k stay; the newest durable is always among them
            self.save_store.delete_prefix(iter_dir(it) + "/")

    def _cleanup_non_persistent(self, keep: str):
        for it in committed_iterations(self.save_store, NON_PERSISTENT):
            name = f"{NON_PERSISTENT}/{iter_dir(it)}"
            if name != keep:
                self.save_store.delete_prefix(name + "/")

    # -- loading --------------------------------------------------------------------------------------
    def load(self, *, finetune: bool = False) -> int:
        """Restore from checkpoint.load (resume; the pods' memory first, when it holds a snapshot no older) or,
        for finetune, weights from pretrained_checkpoint. Returns the iteration it resumed from (0: none). Sets
        `recovery` in every case, at iteration 0 too: a start afresh after snapshots that failed their checks, or
        after a restart, is reported (gang.Recovery.report)."""
        t0 = time.perf_counter()
        iteration = self._load(finetune)
        if self.recovery is None or self.recovery.loaded_from == STORE:
            reason = self.recovery.reason if self.recovery else "memory snapshots are off"
            failed = bool(self.recovery and self.recovery.failed)
            self.recovery = gang.Recovery(STORE, iteration, time.perf_counter() - t0, reason, failed)
        if self.memory is not None:
            self.memory.resumed(iteration)
        return iteration

    def _load(self, finetune: bool) -> int:
        ck = self.cfg.checkpoint
        expected = ck.expected_resume_iteration
        found = resolve_checkpoint(ck.load, ck.ckpt_step, self.cfg) if ck.load else None
        resumed = self._resume_from_memory(found, expected) if self.memory is not None and ck.ckpt_step is None \
            else None
        if resumed is not None:
            return resumed
        if found is None and expected:
            raise ResumeMismatchError(
                f"the operator expects a checkpoint at iteration {expected} but {ck.load} holds none")
        if found is not None:
            return self._resume(*found, expected=expected)
        if ck.exit_on_missing_checkpoint and ck.load and not (finetune or adapters.enabled(self.cfg)):
            raise CheckpointError(f"checkpoint.load={ck.load} holds no complete checkpoint "
                                  "(exit_on_missing_checkpoint is set)")
        if ck.load:
            log.info("checkpoint.load=%s holds no checkpoint: starting at iteration 0 from %s", ck.load,
                     "the pretrained weights" if finetune or adapters.enabled(self.cfg)
                     else "freshly initialized weights")
        if finetune or adapters.enabled(self.cfg):
            self._load_pretrained()
        return 0

    def _resume(self, store, name: str, iteration: int, *, expected: int | None) -> int:
        if expected and iteration < expected:
            raise ResumeMismatchError(f"the operator expects iteration >= {expected}, but the newest "
                                      f"durable checkpoint in {self.cfg.checkpoint.load} is iteration {iteration}")
        self._restore(store, name, full=True)
        log.info("resumed from %s/%s at iteration %d", store.url, name, iteration)
        if not name.startswith(NON_PERSISTENT):
            self.last_durable = iteration
            marker = read_json(store, f"{name}/{MARKER}")
            self.last_durable_time = marker.get("time") if isinstance(marker, dict) else None
        return iteration

    def _load_pretrained(self):
        ck = self.cfg.checkpoint
        if not ck.pretrained_checkpoint:
            raise ConfigError("checkpoint.pretrained_checkpoint", "finetune needs a pretrained checkpoint")
        keep = adapters.is_base_name if adapters.enabled(self.cfg) else None
        hf_record = self.load_hf(self.model, self.cfg, ck.pretrained_checkpoint, keep) if self.load_hf else None
        if hf_record is not None:  # a Hugging Face model directory: converted on load
            self.hf_record = hf_record
            self.optimizer.reload_model_params()
            log.info("finetuning from the Hugging Face model in %s", ck.pretrained_checkpoint)
            return
        found = resolve_checkpoint(ck.pretrained_checkpoint, None, self.cfg, non_persistent=False)
        if found is None:
            raise ConfigError("checkpoint.pretrained_checkpoint",
                              f"no complete checkpoint in {ck.pretrained_checkpoint}")
        store, name, iteration = found
        backend = format_torch_dist.megatron_backend(store, name)
        if backend is not None:  # written by Megatron-LM / Megatron Bridge / megatron-core itself
            self._load_megatron(store, name, backend)
        else:
            self._restore(store, name, full=False)
        log.info("finetuning from weights of %s/%s (iteration %d); training starts at 0", store.url, name, iteration)

    def _load_megatron(self, store, name: str, backend: str):
        if backend != "torch_dist" or adapters.enabled(self.cfg):
            raise ConfigError("checkpoint.pretrained_checkpoint",
                              f"{store.url}/{name} is a megatron-core {backend} checkpoint: kubetron reads megatron's "
                              "torch_dist format" + (", and not as a LoRA base" if backend == "torch_dist" else ""))
        check_architecture(bridge_heads(store, name), self.cfg, name)  # what the tensor shapes cannot tell
        format_torch_dist.load_megatron(self.model, store, name, self.cfg)
        self.optimizer.reload_model_params()

    def _restore(self, store, name, *, full: bool):
        model, optimizer = self.model, self.optimizer
        if format_torch_dist.megatron_backend(store, name) is not None:
            raise ConfigError("checkpoint.load", f"{store.url}/{name} was written by megatron-core (Megatron-LM, "
                                                 "Megatron Bridge): fine-tune from it as "
                                                 "checkpoint.pretrained_checkpoint")
        common = safe_load(store.read_bytes(f"{name}/{COMMON}", limit=MAX_INDEX), f"{name}/{COMMON}")
        if not isinstance(common, dict):
            raise CheckpointError(f"{name}/{COMMON} holds {type(common).__name__}, not kubetron's common state")
        check_version(common, store, name, field="checkpoint.load" if full else "checkpoint.pretrained_checkpoint")
        log_run_config_changes(store, name, self.cfg)
        self.hf_record = common.get("hf", self.hf_record)
        fmt = common.get("ckpt_format") or ("torch_dist" if format_torch_dist.is_dist_checkpoint(store, name)
                                            else "kubetron")
        check_architecture(common.get("model_config", {}), self.cfg, name,
                           saved_tokenizer_vocab=common.get("tokenizer_vocab_size") if fmt == "sharded" else None)
        ck = self.cfg.checkpoint
        device = next(model[0].parameters()).device
        with_optim = full and ck.load_optim
        optim_state = owned = None
        keep = adapters.load_filter(common.get("peft"), self.cfg, name, as_pretrained=not full)
        if keep is adapters.is_adapter_name:  # an adapter-only checkpoint: first the frozen base
            self._load_pretrained()
        if keep is not None and fmt == "torch_dist":
            raise ConfigError("checkpoint.pretrained_checkpoint", f"{name}: LoRA reads its base from a sharded "
                                                                   "or kubetron checkpoint or an HF directory, "
                                                                   "not torch_dist")
        if fmt == "sharded":  # every rank reads only the byte ranges of its own boxes
            reader = format_sharded.ShardReader(store, name, common["num_shards"])
            format_sharded.load_model(model, reader, keep=keep)
            if with_optim and common.get("optim_param_groups") is not None:
                ranges = optimizer.owned_ranges()  # a DP-sharded optimizer reads only its own ranges
                if ranges is not None:
                    owned = format_sharded.load_owned(model, reader, ranges)
                else:
                    optim_state = {"state": format_sharded.load_optimizer(model, reader),
                                   "param_groups": common["optim_param_groups"]}
        elif fmt == "torch_dist":
            optim_state = format_torch_dist.load(model, optimizer, store, name, self.cfg, common,
                                                 with_optimizer=with_optim, device=device)
        else:
            optim_state = format_kubetron.load(model, store, name, keep=keep, with_optim=with_optim)
        optimizer.reload_model_params()  # fp32 mains := the loaded weights (a resume then restores
            # the saved fp32 mains from the optimizer state; finetune keeps these)
        if not full:
            return
        if optim_state is not None:
            load_optimizer_state_by_name(model, optimizer, optim_state, device)
        elif owned is not None:
            load_owned_optimizer_state(optimizer, owned, common["optim_param_groups"], device)
        self._restore_common(common)
        rng_key = f"{name}/{rng_file(_rank())}"
        same_layout = common.get("parallel", {}).get("world_size") == self.world_size
        if ck.load_rng and same_layout and store.exists(rng_key):
            rng = safe_load(store.read_bytes(rng_key, limit=MAX_SMALL), rng_key)
            if rng:  # empty: saved with checkpoint.save_rng false by an older kubetron
                set_rng_state(rng, rng_key)


def adopt_checkpoint_tokenizer(cfg) -> str | None:
    """On a resume, use the tokenizer files saved in the checkpoint (not the configured paths, which may be
    gone or changed since). Call before the first cfg.finalize(): the padded vocabulary comes from the tokenizer.
    Returns the checkpoint it came from, or None."""
    ck, tok = cfg.checkpoint, cfg.tokenizer
    if not ck.load or not tok.file_based:
        return None
    found = resolve_checkpoint(ck.load, ck.ckpt_step, cfg)
    if found is None:
        return None
    store, name, _ = found
    assets = read_tokenizer_assets(store, name)
    if not assets:
        return None
    tok.adopt_assets(None)
    try:
        from kubetron.data.tokenizer import tokenizer_assets

        if tokenizer_assets(cfg) != assets:
            log.warning("the tokenizer files at the configured paths differ from %s/%s/%s; resuming with the "
                        "checkpoint's", store.url, name, TOKENIZER_DIR)
    except ConfigError:
        log.warning("the configured tokenizer files are not readable; resuming with %s/%s/%s",
                    store.url, name, TOKENIZER_DIR)
    tok.adopt_assets(assets)
    log.info("tokenizer: %s from %s/%s/%s (the checkpoint being resumed)", tok.tokenizer_type, store.url, name,
             TOKENIZER_DIR)
    return f"{store.url}/{name}"

