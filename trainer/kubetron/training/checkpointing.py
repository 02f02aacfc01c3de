"""Checkpoints in Megatron's layout, through the storage layer (a path/PVC or s3:// alike).

    <save>/iter_0000020/{model.pt, optim.pt, common.pt, rng/rank_00000.pt, run_config.yaml, tokenizer/*,
                         metadata.json}          metadata.json = commit marker, written last
    <save>/latest_train_state.pt                 tracker, replaced atomically after the commit
    <save>/progress.txt                          "Saved checkpoint" appended once durable

Tensors are stored in *canonical* form: full (unsharded) tensors under the names a TP=1/PP=1 model
uses, so a checkpoint loads into any parallel layout (`sharding.py` gathers and scatters).
Every load is `torch.load(..., weights_only=True)`: a checkpoint can never run code.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import re
import signal
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import torch
import torch.distributed as dist
import yaml

from kubetron.contract import progress as progress_log
from kubetron.contract.errors import CheckpointError, ConfigError, ResumeMismatchError
from kubetron.progress_io import in_place_restarts, job_id
from kubetron.storage import open_store
from kubetron.training import comm, dist_ckpt, peft, sharded, sharding

log = logging.getLogger("kubetron")

TRACKER = "latest_train_state.pt"
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "metadata.json"
NON_PERSISTENT = "non_persistent"
TOKENIZER_DIR = "tokenizer"
CHECKPOINT_VERSION = 1
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# Architecture fields that must match between a checkpoint and the model loading it.
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "vocab_size", "position_embedding_type", "normalization", "activation", "add_bias_linear",
               "share_embeddings_and_output_weights", "sliding_window", "qk_layernorm", "kv_channels",
               "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
               "moe_shared_expert_intermediate_size")


def arch_value(model, field: str):
    """A field of a `model:` section (GPTModelConfig) as it decides the architecture: kv_channels is the
    head size (null and hidden_size / num_attention_heads are the same model); the moe_ fields only with
    experts (null for a dense model), moe_layer_freq as one 0/1 per layer, moe_ffn_hidden_size resolved."""
    if field == "kv_channels":
        return model.head_size()
    if field.startswith("moe_") and model.num_moe_experts is None:
        return None
    if field == "moe_layer_freq":
        return model.moe_layer_pattern()
    if field == "moe_ffn_hidden_size":
        return model.moe_ffn_hidden_size or model.ffn_hidden_size
    return getattr(model, field)


def arch_record(model) -> dict:
    """The ARCH_FIELDS of a `model:` section, as common.pt records them."""
    return {f: arch_value(model, f) for f in ARCH_FIELDS}


def _chaos(point: str, iteration: int):
    """Fault injection for the store's guarantees: KUBETRON_CHAOS_KILL_AT=<point>[@<iteration>] SIGKILLs
    this process at that point of a save (after-shard, after-model, after-payload, after-commit,
    after-tracker); with KUBETRON_CHAOS_RANK=<r> only global rank r dies."""
    spec = os.environ.get("KUBETRON_CHAOS_KILL_AT")
    only = os.environ.get("KUBETRON_CHAOS_RANK")
    if spec and spec in (point, f"{point}@{iteration}") and (not only or int(only) == _rank()):
        os.kill(os.getpid(), signal.SIGKILL)


def iter_dir(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _safe_load(data: bytes | io.IOBase, what: str):
    """torch.load that refuses anything but tensors and plain containers (no code from a store)."""
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:200]
        raise CheckpointError(f"refusing to load {what}: it holds objects other than tensors and plain "
                              f"data, and loading it could run code ({first})") from None
    except Exception as e:  # truncated/corrupt file
        raise CheckpointError(f"cannot read {what}: {type(e).__name__}: {e}") from None


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --- RNG ---------------------------------------------------------------------------------------------

def get_rng_state() -> dict:
    """python, numpy, torch (and CUDA) generator states, in weights_only-loadable types."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "random": [py[0], list(py[1]), py[2]],
        "np": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
               "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    py = state["random"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["np"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- what goes into a checkpoint --------------------------------------------------------------------

@dataclass
class Snapshot:
    """Host-memory copy of everything a checkpoint holds (what an async save blocks for)."""

    iteration: int
    model: dict | None  # kubetron format: canonical tensors (rank 0 only)
    optim: dict | None
    shard: sharded.RankShard | None  # sharded format: this rank's pieces
    common: dict | None
    rng: dict
    run_config: str | None
    progress_fields: dict | None
    tokenizer: dict | None = None  # {file name: bytes} of a file-based tokenizer (rank 0 only)
    copied: object = None  # CUDA: an event after the device→host copies (the buffers are valid once it is)


def optimizer_state_by_name(model, optimizer, with_state: bool = True) -> dict:
    """Optimizer state keyed by parameter name (not by position), so layouts can change
    (with_state=False: the param groups only)."""
    names = {id(p): n for chunk in model for n, p in chunk.named_parameters()}
    states = {}
    for p, s in (optimizer.state.items() if with_state else ()):
        states[names[id(p)]] = dict(s)  # live tensors: the gather below copies them to the host
    return {"state": states, "param_groups": param_groups_of(optimizer)}


def param_groups_of(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _restore_param_groups(optimizer, saved_groups: list[dict]):
    for g, sg in zip(optimizer.param_groups, saved_groups):
        for k, v in sg.items():
            if k != "params":
                g[k] = v


def _state_on(device, optimizer, state: dict) -> dict:
    """Saved state tensors onto the parameters' device (`step` stays on the host unless the optimizer
    is fused, as torch keeps it)."""
    fused = optimizer.defaults.get("fused")
    return {k: (v.to(device) if torch.is_tensor(v) and (k != "step" or fused) else v) for k, v in state.items()}


def load_optimizer_state_by_name(model, optimizer, saved: dict, device):
    """Restore state saved by optimizer_state_by_name. An fp32 main weight (`main_param`, saved by a
    bf16 run's MainParamsOptimizer) becomes the main weight again, or, for a plain optimizer over
    fp32 parameters, the parameter itself (more precise than the bf16 weight in model.pt)."""
    # the parameters the optimizer steps (LoRA: frozen base weights have no state)
    by_name = {n: p for chunk in model for n, p in chunk.named_parameters() if p.requires_grad}
    missing = [n for n in by_name if n not in saved["state"]]
    if missing and saved["state"]:
        raise CheckpointError(f"optimizer state lacks {len(missing)} parameters (e.g. {missing[0]})")
    for name, s in saved["state"].items():
        p = by_name.get(name)
        if p is None:
            raise CheckpointError(f"optimizer state has a parameter this model lacks: {name}")
        optimizer.set_param_state(p, _state_on(device, optimizer, s))
    _restore_param_groups(optimizer, saved["param_groups"])


def load_owned_optimizer_state(optimizer, owned: list[tuple], param_groups: list[dict], device):
    """Restore a DP-sharded optimizer from the state of the ranges it owns (sharded.load_owned)."""
    for p, lo, hi, state in owned:
        optimizer.set_owned_state(p, lo, hi, _state_on(device, optimizer, state))
    _restore_param_groups(optimizer, param_groups)


class ProgressLog:
    """The progress log `progress.txt` beside the checkpoints (rank 0 writes; Megatron's line format)."""

    def __init__(self, cfg, store, state):
        self.cfg, self.store, self.state = cfg, store, state
        self._start_wall = time.time()
        self._start_flops: float | None = None
        self._job_start_time = None  # the job's first start at this GPU count, from the log (read at start())
        self._job_start_flops = 0.0  # the FLOPs done before it (saved by runs at other GPU counts)

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.logger.log_progress and self.store is not None and _rank() == 0)

    def start(self):
        if self.enabled:
            self._start_flops = self.state.train_state.floating_point_operations_so_far
            if in_place_restarts():
                self.store.append_line("progress.txt", progress_log.restarted_in_place_line(
                    iteration=self.state.train_state.step, restarts=in_place_restarts(),
                    train_iters=self.cfg.train.train_iters, num_gpus=self.state.world_size, job_id=job_id()))
            self.store.append_line("progress.txt", progress_log.starting_job_line(
                iteration=self.state.train_state.step, train_iters=self.cfg.train.train_iters,
                num_gpus=self.state.world_size, job_id=job_id()))
            self._job_start_time, self._job_start_flops = self._job_start()

    def exit(self, reason: str):
        if self.enabled:
            self.store.append_line("progress.txt", progress_log.exiting_job_line(
                iteration=self.state.train_state.step, reason=reason, train_iters=self.cfg.train.train_iters,
                num_gpus=self.state.world_size, job_id=job_id()))

    def saved(self, fields: dict, *, async_save: bool):
        if self.enabled:
            line = progress_log.saved_checkpoint_line(**fields, async_save=async_save, job_id=job_id())
            self.store.append_line("progress.txt", line)

    def fields(self, iteration: int) -> dict:
        """Throughput and counters for a "Saved checkpoint" line, taken when the snapshot is."""
        ts, cfg = self.state.train_state, self.cfg
        elapsed = max(time.time() - self._start_wall, 1e-9)
        flops = ts.floating_point_operations_so_far
        ngpu = self.state.world_size
        job_tp = (flops - (self._start_flops or 0.0)) / elapsed / ngpu / 1e12
        start = self._job_start_time  # read at start(): no store access in the loop
        cum_elapsed = max(time.time() - start.timestamp(), 1e-9) if start else elapsed
        return dict(iteration=iteration, job_throughput_tflops=job_tp,
                    cumulative_throughput_tflops=(flops - self._job_start_flops) / cum_elapsed / ngpu / 1e12,
                    flops_so_far=flops,
                    tokens_so_far=ts.consumed_train_samples * cfg.model.seq_length,
                    train_iters=cfg.train.train_iters, num_gpus=ngpu)

    def _job_start(self):
        try:
            text = self.store.read_bytes("progress.txt").decode() if self.store.exists("progress.txt") else ""
        except Exception:
            return None, 0.0
        return progress_log.get_start_time_from_progress_log(text, self.state.world_size)


def open_save_store(cfg):
    """The store checkpoint.save names (None: saving off)."""
    ck = cfg.checkpoint
    return open_store(ck.save, endpoint_url=ck.s3_endpoint_url, region=ck.s3_region) if ck.save else None


class CheckpointManager:
    """save(step)/load() for the loop: it owns what a checkpoint holds (model chunks, optimizer,
    scheduler, data iterators), the host buffers snapshots are copied into, and the progress log."""

    def __init__(self, cfg, store, *, state, model, optimizer, scheduler, data=(None, None), run_id: str):
        self.cfg, self.save_store, self.state = cfg, store, state
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data
        self.run_id = run_id  # same on all ranks: names the save transaction
        self.progress = ProgressLog(cfg, store, state)
        self.buffers = sharding.HostBuffers()
        self._plan: dict = {}  # sharded.snapshot's cuts, worked out at the first save (the layout is fixed)
        ck = cfg.checkpoint
        self.local_store = None  # non-persistent "local": this rank's own directory on node-local disk
        if ck.non_persistent_ckpt_type == "local" and ck.non_persistent_local_ckpt_dir:
            self.local_store = open_store(f"{ck.non_persistent_local_ckpt_dir.rstrip('/')}/rank_{_rank():05d}")
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
        self._run_config_yaml: str | None = None
        self._tokenizer_assets: dict[str, bytes] | None = None
        self.hf_record: dict | None = None  # the HF base's special ids + generation config (kubetron.hf.generation)

    @property
    def enabled(self) -> bool:
        return self.save_store is not None

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
    def snapshot(self, iteration: int) -> Snapshot:
        """Copy what this rank saves to host memory (the only part of an async save that blocks; on CUDA
        the copies are only queued). sharded: this rank's own pieces; kubetron: full tensors gathered
        onto rank 0. The CPU copies of the sharded pieces run last, together (HostBuffers.batch)."""
        with self.buffers.batch():
            return self._snapshot(iteration)

    def _snapshot(self, iteration: int) -> Snapshot:
        fmt, ck = self.cfg.checkpoint.ckpt_format, self.cfg.checkpoint
        self.optimizer.finish_param_sync()  # weights still being all-gathered (ddp.overlap_param_gather)
        model_sd = optim_sd = shard = None
        # a DP-sharded optimizer's own ranges go straight into the sharded format (no gather)
        owned = self.optimizer.owned_state() if ck.save_optim and fmt == "sharded" else None
        by_name = optimizer_state_by_name(self.model, self.optimizer, with_state=owned is None) \
            if ck.save_optim and fmt != "torch_dist" else None
        if fmt == "sharded":
            shard = sharded.snapshot(self.model, by_name["state"] if by_name else None,
                                     self.buffers, keep=peft.is_adapter_name if peft.enabled(self.cfg) else None,
                                     owned=owned, plan=self._plan)
        elif fmt == "kubetron":  # (torch_dist: every rank writes in write())
            model_sd = sharding.gather_model_state(self.model, self.buffers)
            optim_sd = sharding.gather_optimizer_state(self.model, by_name, self.buffers) if by_name else None
        rank0 = _rank() == 0
        common = self._common_state(iteration, by_name) if rank0 else None
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
            progress_fields=self.progress.fields(iteration) if rank0 else None,
            tokenizer=self._tokenizer_files() if rank0 else None,
            copied=copied,
        )

    def save(self, step: int, *, non_persistent: bool = False, blocking: bool | None = None):
        """Save iteration `step` (the loop's train_state.step). Async saves return after the snapshot."""
        if non_persistent and self.local_store is not None:
            return self._save_local(step)
        if not self.enabled:
            return
        t0 = time.perf_counter()
        self.finalize(blocking=True)  # one save in flight at a time
        snap = self.snapshot(step)
        name = (f"{NON_PERSISTENT}/" if non_persistent else "") + iter_dir(step)
        use_async = self.async_saver is not None and not (blocking or False)
        holder = {}  # the transaction is opened in write(): on S3 that is a few requests, off the loop
        write = lambda: self._write(name, snap, holder)  # noqa: E731
        finalize = lambda: self._commit(name, snap, holder, non_persistent, use_async, t0)  # noqa: E731
        if use_async:
            self.async_saver.schedule(write, finalize)
            log.info("async save of %s scheduled; the loop was blocked %.3fs", name, time.perf_counter() - t0)
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
        if snap.copied is not None:
            snap.copied.synchronize()
        txn = holder["txn"] = self.save_store.begin_dir(name, txn_id=f"{self.run_id}-{it}")
        if snap.rng:  # checkpoint.save_rng: false writes none (and a resume keeps this run's seeds)
            txn.write_bytes(f"rng/rank_{rank:05d}.pt", _to_bytes(snap.rng))
        if snap.shard is not None:
            self.last_save_bytes = sharded.write(txn, rank, snap.shard, after_data=lambda: _chaos("after-shard", it))
        if self.cfg.checkpoint.ckpt_format == "torch_dist":  # collective; sync saves only (config)
            common = dist_ckpt.megatron_common(it, self.scheduler.state_dict(), self.state.train_state.state_dict())
            facts = dist_ckpt.save(self.model, self.optimizer, txn, self.cfg,
                                   with_optimizer=self.cfg.checkpoint.save_optim, common=common)
            if snap.common is not None and facts:
                snap.common["dist_optimizer"] = facts
        if snap.common is not None:
            for key, obj in (("model.pt", snap.model), ("optim.pt", snap.optim), ("common.pt", snap.common)):
                if obj is not None:
                    with txn.open_write(key) as f:
                        torch.save(obj, f)
                    _chaos(f"after-{key[:-3]}", it)
            txn.write_bytes("run_config.yaml", snap.run_config.encode())
            for file_name, data in (snap.tokenizer or {}).items():  # a checkpoint is self-contained
                txn.write_bytes(f"{TOKENIZER_DIR}/{file_name}", data)
        _chaos("after-payload", it)

    def _commit(self, name: str, snap: Snapshot, holder: dict, non_persistent: bool, use_async: bool, t0: float):
        """Collective: once every rank's files are durable, rank 0 writes the marker, then the tracker."""
        _barrier()  # every rank's files are written
        if _rank() == 0:
            marker = {"iteration": snap.iteration, "time": _now_iso(), "run_id": self.run_id,
                      "checkpoint_version": CHECKPOINT_VERSION, "world_size": self.state.world_size}
            holder["txn"].commit(json.dumps(marker).encode())
            _chaos("after-commit", snap.iteration)
            if not non_persistent:
                tracker = {"iteration": snap.iteration, "train_state": snap.common["train_state"],
                           "time": marker["time"]}
                self.save_store.replace_tracker(TRACKER, _to_bytes(tracker))
                _chaos("after-tracker", snap.iteration)
                self.progress.saved(snap.progress_fields, async_save=use_async)
                self._apply_retention()
            else:
                self._cleanup_non_persistent(keep=name)
        _barrier()
        if not non_persistent:
            self.last_durable, self.last_durable_time = snap.iteration, _now_iso()
        log.info("saved checkpoint %s at iteration %d (%.2fs)", name, snap.iteration, time.perf_counter() - t0)

    def finalize(self, blocking: bool = False):
        """Finish async saves that are done (or all, if blocking). Collective when world_size > 1:
        a save is finalized only once every rank's background write has finished."""
        saver = self.async_saver
        if saver is None or not saver.pending:  # the same on every rank: saves start and end together,
            return  # so the loop pays the collective below only while a save is in flight
        if blocking or not (dist.is_initialized() and dist.get_world_size() > 1):
            saver.maybe_finalize(blocking=blocking)
            return
        if comm.all_ranks(saver.ready()):
            saver.maybe_finalize(blocking=True)

    def close(self):
        if self.async_saver is not None:
            self.async_saver.maybe_finalize(blocking=True)
            self.async_saver.close()
            self.async_saver = None

    def _common_state(self, iteration: int, by_name: dict | None) -> dict:
        ts, fmt = self.state.train_state, self.cfg.checkpoint.ckpt_format
        train_it, valid_it = self.data
        common = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "train_state": ts.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": {"train": train_it.state_dict() if train_it is not None else None,
                     "valid": valid_it.state_dict() if valid_it is not None else None},
            "model_config": arch_record(self.cfg.model),
            "tokenizer_vocab_size": _tokenizer_vocab(self.cfg),
            "parallel": {"world_size": self.state.world_size, "tp": self.cfg.model.tensor_model_parallel_size,
                         "pp": self.cfg.model.pipeline_model_parallel_size, "dp": self.cfg.data_parallel_size},
            "ckpt_format": fmt,
        }
        if peft.enabled(self.cfg):  # adapter-only: the base is the pretrained checkpoint's
            common["peft"] = peft.checkpoint_info(self.cfg)
        if self.hf_record:  # carried from the pretrained checkpoint to export-hf
            common["hf"] = self.hf_record
        if self.optimizer.loss_scaler is not None:  # fp16: a resume continues with the same scale
            common["loss_scaler"] = self.optimizer.loss_scaler.state_dict()
        if fmt == "sharded":
            common["num_shards"] = self.state.world_size
            common["optim_param_groups"] = by_name["param_groups"] if by_name else None
        return common

    # -- non-persistent "local": rank-local shards, resumable at the same layout only -------------------
    def _save_local(self, step: int):
        """Every rank writes its own shard (model chunk, optimizer, RNG) to its node-local directory."""
        self.optimizer.finish_param_sync()
        t0 = time.perf_counter()
        name = iter_dir(step)
        state = {
            "model": {k: v.detach().cpu() for k, v in self.model[0].state_dict().items()
                      if not k.endswith("_extra_state")},
            "optim": self.optimizer.state_dict(),
            "common": self._common_state(step, None),
            "rng": get_rng_state(),
        }
        txn = self.local_store.begin_dir(name, primary=True)
        try:
            with txn.open_write("state.pt") as f:
                torch.save(state, f)
            txn.commit(json.dumps({"iteration": step, "time": _now_iso(), "rank": _rank()}).encode())
        except Exception:
            txn.abort()
            raise
        for it in committed_iterations(self.local_store):  # keep only the newest
            if it != step:
                self.local_store.delete_prefix(iter_dir(it) + "/")
        _barrier()
        log.info("saved local non-persistent checkpoint %s (%.2fs)", name, time.perf_counter() - t0)

    def _agreed_local_iteration(self) -> int | None:
        """The newest local checkpoint that every rank has (same layout), or None."""
        mine = -1
        if self.local_store is not None:
            its = committed_iterations(self.local_store)
            mine = its[-1] if its else -1
        t = torch.tensor([mine], dtype=torch.int64, device=comm.collective_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item()) if t.item() >= 0 else None

    def _restore_local(self, iteration: int):
        key = f"{iter_dir(iteration)}/state.pt"
        with self.local_store.open_read(key) as f:
            state = _safe_load(f, key)
        common = state["common"]
        check_architecture(common["model_config"], self.cfg, key)
        if common["parallel"]["world_size"] != self.state.world_size:
            raise CheckpointError(f"local checkpoint {key} was saved with world size "
                                  f"{common['parallel']['world_size']}, this run has {self.state.world_size}")
        missing, unexpected = self.model[0].load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointError(f"local checkpoint {key} does not match the model: {missing[:3]} {unexpected[:3]}")
        if self.cfg.checkpoint.load_optim:
            self.optimizer.load_state_dict(state["optim"])
        else:
            self.optimizer.reload_model_params()
        self._restore_common(common)
        if self.cfg.checkpoint.load_rng:
            set_rng_state(state["rng"])

    def _restore_common(self, common):
        """Train state and data positions; the LR scheduler and fp16 loss scale only with the optimizer
        state (checkpoint.load_optim), as Megatron: without it they start afresh."""
        from kubetron.training.state import TrainState

        if self.cfg.checkpoint.load_optim:
            self.scheduler.load_state_dict(common["scheduler"])
            if self.optimizer.loss_scaler is not None and common.get("loss_scaler"):
                self.optimizer.loss_scaler.load_state_dict(common["loss_scaler"])
        self.state.train_state = TrainState.from_state_dict(common["train_state"])
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
        """Restore from checkpoint.load (resume) or, for finetune, weights from pretrained_checkpoint."""
        ck = self.cfg.checkpoint
        expected = ck.expected_resume_iteration
        found = resolve_checkpoint(ck.load, ck.ckpt_step, self.cfg) if ck.load else None
        local_it = self._agreed_local_iteration() if self.local_store is not None else None
        if local_it is not None and (found is None or local_it > found[2]) and not (expected and local_it < expected):
            self._restore_local(local_it)
            log.info("resumed from local non-persistent checkpoint at iteration %d", local_it)
            return local_it
        if found is None and expected:
            raise ResumeMismatchError(
                f"the operator expects a checkpoint at iteration {expected} but {ck.load} holds none")
        if found is not None:
            return self._resume(*found, expected=expected)
        if finetune or peft.enabled(self.cfg):
            self._load_pretrained()
        elif ck.exit_on_missing_checkpoint and ck.load:
            raise CheckpointError(f"checkpoint.load={ck.load} holds no complete checkpoint "
                                  "(exit_on_missing_checkpoint is set)")
        return 0

    def _resume(self, store, name: str, iteration: int, *, expected: int | None) -> int:
        if expected and iteration < expected:
            raise ResumeMismatchError(f"the operator expects iteration >= {expected}, but the newest "
                                      f"durable checkpoint in {self.cfg.checkpoint.load} is iteration {iteration}")
        self._restore(store, name, full=True)
        log.info("resumed from %s/%s at iteration %d", store.url, name, iteration)
        if not name.startswith(NON_PERSISTENT):
            self.last_durable = iteration
            self.last_durable_time = json.loads(store.read_bytes(f"{name}/{MARKER}")).get("time")
        return iteration

    def _load_pretrained(self):
        ck = self.cfg.checkpoint
        if not ck.pretrained_checkpoint:
            raise ConfigError("checkpoint.pretrained_checkpoint", "finetune needs a pretrained checkpoint")
        from kubetron.hf import is_hf_dir

        if is_hf_dir(ck.pretrained_checkpoint):  # a Hugging Face model directory: converted on load
            from kubetron.hf.generation import record_of_hf_dir
            from kubetron.hf.io import load_hf_into_model

            self.hf_record = record_of_hf_dir(ck.pretrained_checkpoint)
            load_hf_into_model(self.model, self.cfg, ck.pretrained_checkpoint,
                               keep=peft.is_base_name if peft.enabled(self.cfg) else None)
            self.optimizer.reload_model_params()
            log.info("finetuning from the Hugging Face model in %s", ck.pretrained_checkpoint)
            return
        found = resolve_checkpoint(ck.pretrained_checkpoint, None, self.cfg, non_persistent=False)
        if found is None:
            raise ConfigError("checkpoint.pretrained_checkpoint",
                              f"no complete checkpoint in {ck.pretrained_checkpoint}")
        store, name, iteration = found
        backend = dist_ckpt.megatron_backend(store, name)
        if backend is not None:  # written by Megatron-LM / Megatron Bridge / megatron-core itself
            self._load_megatron(store, name, backend)
        else:
            self._restore(store, name, full=False)
        log.info("finetuning from weights of %s/%s (iteration %d); training starts at 0", store.url, name, iteration)

    def _load_megatron(self, store, name: str, backend: str):
        if backend != "torch_dist" or peft.enabled(self.cfg):
            raise ConfigError("checkpoint.pretrained_checkpoint",
                              f"{store.url}/{name} is a megatron-core {backend} checkpoint: kubetron reads megatron's "
                              "torch_dist format" + (", and not as a LoRA base" if backend == "torch_dist" else ""))
        check_architecture(bridge_heads(store, name), self.cfg, name)  # what the tensor shapes cannot tell
        dist_ckpt.load_megatron(self.model, store, name, self.cfg)
        self.optimizer.reload_model_params()

    def _restore(self, store, name, *, full: bool):
        model, optimizer = self.model, self.optimizer
        if dist_ckpt.megatron_backend(store, name) is not None:
            raise ConfigError("checkpoint.load", f"{store.url}/{name} was written by megatron-core (Megatron-LM, "
                                                 "Megatron Bridge): fine-tune from it as "
                                                 "checkpoint.pretrained_checkpoint")
        common = _safe_load(store.read_bytes(f"{name}/common.pt"), f"{name}/common.pt")
        check_version(common, store, name, field="checkpoint.load" if full else "checkpoint.pretrained_checkpoint")
        log_run_config_changes(store, name, self.cfg)
        self.hf_record = common.get("hf", self.hf_record)
        fmt = common.get("ckpt_format") or ("torch_dist" if dist_ckpt.is_dist_checkpoint(store, name) else "kubetron")
        check_architecture(common.get("model_config", {}), self.cfg, name,
                           saved_tokenizer_vocab=common.get("tokenizer_vocab_size") if fmt == "sharded" else None)
        ck = self.cfg.checkpoint
        device = next(model[0].parameters()).device
        with_optim = full and ck.load_optim
        optim_state = owned = None
        keep = peft.load_filter(common.get("peft"), self.cfg, name, as_pretrained=not full)
        if keep is peft.is_adapter_name:  # an adapter-only checkpoint: first the frozen base
            self._load_pretrained()
        if keep is not None and fmt == "torch_dist":
            raise ConfigError("checkpoint.pretrained_checkpoint", f"{name}: LoRA reads its base from a sharded "
                                                                   "or kubetron checkpoint or an HF directory, "
                                                                   "not torch_dist")
        if fmt == "sharded":  # every rank reads only the byte ranges of its own boxes
            reader = sharded.ShardReader(store, name, common["num_shards"])
            sharded.load_model(model, reader, keep=keep)
            if with_optim and common.get("optim_param_groups") is not None:
                ranges = optimizer.owned_ranges()  # a DP-sharded optimizer reads only its own ranges
                if ranges is not None:
                    owned = sharded.load_owned(model, reader, ranges)
                else:
                    optim_state = {"state": sharded.load_optimizer(model, reader),
                                   "param_groups": common["optim_param_groups"]}
        elif fmt == "torch_dist":
            optim_state = dist_ckpt.load(model, optimizer, store, name, self.cfg, common, with_optimizer=with_optim,
                                         device=device)
        else:
            with store.open_read(f"{name}/model.pt") as f:
                sharding.load_model_state(model, _safe_load(f, f"{name}/model.pt"), keep=keep)
            if with_optim and store.exists(f"{name}/optim.pt"):
                with store.open_read(f"{name}/optim.pt") as f:
                    optim_state = sharding.scatter_optimizer_state(model, _safe_load(f, f"{name}/optim.pt"))
        optimizer.reload_model_params()  # fp32 mains := the loaded weights (a resume then restores
            # the saved fp32 mains from the optimizer state; finetune keeps these)
        if not full:
            return
        if optim_state is not None:
            load_optimizer_state_by_name(model, optimizer, optim_state, device)
        elif owned is not None:
            load_owned_optimizer_state(optimizer, owned, common["optim_param_groups"], device)
        self._restore_common(common)
        rng_key = f"{name}/rng/rank_{_rank():05d}.pt"
        same_layout = common.get("parallel", {}).get("world_size") == self.state.world_size
        if ck.load_rng and same_layout and store.exists(rng_key):
            rng = _safe_load(store.read_bytes(rng_key), rng_key)
            if rng:  # empty: saved with checkpoint.save_rng false by an older kubetron
                set_rng_state(rng)


def read_tokenizer_assets(store, name: str) -> dict[str, bytes]:
    """{file name: bytes} of a checkpoint's tokenizer/ directory ({} for byte/null or older checkpoints)."""
    prefix = f"{name}/{TOKENIZER_DIR}/"
    return {key[len(prefix):]: store.read_bytes(key) for key in store.list(prefix.rstrip("/"))
            if key.startswith(prefix)}


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


def _tokenizer_vocab(cfg) -> int | None:
    """The tokenizer's own vocabulary (before padding), when the config names one."""
    try:
        return cfg.tokenizer.base_vocab_size()
    except ConfigError:
        return None


def check_architecture(saved: dict, cfg, name: str, saved_tokenizer_vocab: int | None = None):
    """Resume asserts what it restores: the model shape must match, field by field. A sharded
    checkpoint may differ in the padded vocabulary (it grows with TP) when the tokenizer is the same."""
    same_tokenizer = saved_tokenizer_vocab is not None and saved_tokenizer_vocab == _tokenizer_vocab(cfg)
    current = arch_record(cfg.model)
    diffs = [f"model.{k}: checkpoint {saved[k]!r}, this run {current[k]!r}"
             for k in ARCH_FIELDS if k in saved and saved[k] != current[k]
             and not (k == "vocab_size" and same_tokenizer)]
    if diffs:  # a spec error no retry fixes (exit 2): the first differing field is named
        field = diffs[0].split(":")[0]
        raise ConfigError(field, f"{name} does not match this model: " + "; ".join(diffs))


def bridge_heads(store, name: str) -> dict:
    """num_attention_heads / num_query_groups from a Megatron Bridge checkpoint's run_config.yaml (safe YAML;
    {} without one, e.g. Megatron-LM's, whose args sit in a pickle that is never read)."""
    key = f"{name}/run_config.yaml"
    if not store.exists(key):
        return {}
    try:
        model = (yaml.safe_load(store.read_bytes(key)) or {}).get("model") or {}
    except (yaml.YAMLError, AttributeError) as e:
        log.warning("%s: not read (%s); the attention heads are not checked", key, str(e).splitlines()[0][:100])
        return {}
    heads = model.get("num_attention_heads")
    groups = model.get("num_query_groups") or heads
    return {k: v for k, v in (("num_attention_heads", heads), ("num_query_groups", groups)) if isinstance(v, int)}


def check_version(common: dict, store, name: str, field: str = "checkpoint.load"):
    """A checkpoint written by a newer kubetron (unknown layout) is refused with one line naming `field`."""
    version = common.get("checkpoint_version")
    if not isinstance(version, int) or not 1 <= version <= CHECKPOINT_VERSION:
        raise ConfigError(field, f"{store.url}/{name} has checkpoint version {version!r}; this kubetron "
                                 f"reads versions 1..{CHECKPOINT_VERSION} (use the kubetron that wrote it)")


def run_config_changes(saved_yaml: str, cfg) -> list[str]:
    """`section.key: old -> new` for every setting that differs from the saved run_config.yaml."""
    saved = yaml.safe_load(saved_yaml) or {}
    now = cfg.to_dict()
    changes = []
    for section, values in saved.items():
        if not isinstance(values, dict) or not isinstance(now.get(section), dict):
            continue
        for key, old in values.items():
            new = now[section].get(key, old)
            if new != old:
                changes.append(f"{section}.{key}: {old!r} -> {new!r}")
    return changes


def log_run_config_changes(store, name: str, cfg):
    """A resume reads the run_config.yaml it resumes from and names what this run changes."""
    key = f"{name}/run_config.yaml"
    if _rank() != 0 or not store.exists(key):
        return
    changes = run_config_changes(store.read_bytes(key).decode(), cfg)
    if changes:
        log.info("settings changed since %s: %s", name, "; ".join(changes))


def committed_iterations(store, prefix: str = "") -> list[int]:
    """Iterations with a commit marker, oldest first (partial saves are invisible)."""
    base = (prefix.rstrip("/") + "/") if prefix else ""
    its = []
    for d in store.list_dirs(base):
        m = _ITER_RE.match(d)
        if m and store.exists(f"{base}{d}/{MARKER}"):
            its.append(int(m.group(1)))
    return sorted(its)


def tracked_iteration(store) -> int | None:
    """The iteration the tracker names: kubetron's `latest_train_state.pt` ({"iteration": ...}), Megatron
    Bridge's (its TrainState, {"step": ...}) or Megatron-LM's `latest_checkpointed_iteration.txt`."""
    if store.exists(TRACKER):
        tracker = _safe_load(store.read_bytes(TRACKER), TRACKER)
        value = tracker.get("iteration", tracker.get("step")) if isinstance(tracker, dict) else None
    elif store.exists(MEGATRON_LM_TRACKER):
        value = store.read_bytes(MEGATRON_LM_TRACKER).decode(errors="replace").strip()
    else:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"{store.url}: the tracker names no iteration ({str(value)[:40]!r})") from None


def resolve_checkpoint(location: str, ckpt_step: int | None, cfg, non_persistent: bool = True):
    """(store, dir name, iteration) of the checkpoint to load, or None if there is none.

    `location` may be an iter_ directory itself. Otherwise: ckpt_step if given; else the tracker,
    checked against its commit marker, else the newest committed iteration; a newer non-persistent
    checkpoint wins.
    """
    ck = cfg.checkpoint
    loc = location.rstrip("/")
    parent, _, leaf = loc.rpartition("/")
    m = _ITER_RE.match(leaf)
    if m:  # an iter_ directory itself (`iter_0000030` alone means ./iter_0000030)
        store = open_store(parent or ".", endpoint_url=ck.s3_endpoint_url, region=ck.s3_region)
        if not store.exists(f"{leaf}/{MARKER}"):
            raise CheckpointError(f"{location} is not a complete checkpoint (no {MARKER})")
        return store, leaf, int(m.group(1))
    store = open_store(loc, endpoint_url=ck.s3_endpoint_url, region=ck.s3_region)
    durable = committed_iterations(store)
    if ckpt_step is not None:
        if ckpt_step not in durable:
            raise ConfigError("checkpoint.ckpt_step", f"{ckpt_step}: {loc} has no complete {iter_dir(ckpt_step)}"
                                                      f" (complete: {durable[-5:]})")
        return store, iter_dir(ckpt_step), ckpt_step
    best = None
    tracked = tracked_iteration(store)
    if tracked is not None:
        if tracked in durable:
            best = tracked
        else:
            log.warning("tracker points at iteration %d which is not complete; using the newest complete one",
                        tracked)
    if best is None and durable:
        best = durable[-1]
    candidates = [] if best is None else [(best, iter_dir(best))]
    if non_persistent:
        np_its = committed_iterations(store, NON_PERSISTENT)
        if np_its:
            candidates.append((np_its[-1], f"{NON_PERSISTENT}/{iter_dir(np_its[-1])}"))
    if not candidates:
        return None
    iteration, name = max(candidates)
    return store, name, iteration


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
