"""Data-parallel gradient buffers and the distributed optimizer (`ddp.*`), on plain torch.distributed.

megatron-core's `DistributedDataParallel` and `DistributedOptimizer` hard-code CUDA in 0.16.1 (grad
buffers on `torch.cuda.current_device()`, `torch.cuda.current_stream()` in the grad sync, CUDA asserts
in `get_megatron_optimizer`; see docs/parallelism.md), so they cannot run in CI. This module, the
`ddp.impl: kubetron` implementation (CPU, and the GPU fallback; on CUDA `auto` picks megatron-core's,
megatron_ddp.py), does the same scheme with collectives that gloo and NCCL both have:

Gradient buffers (`GradBuffers`, for `ddp.overlap_grad_reduce` and the distributed optimizer):
- every trainable parameter gets a slice of one contiguous gradient buffer per parameter dtype
  (fp32 when `ddp.grad_reduce_in_fp32`), filled in reverse registration order (about the order the
  backward pass produces gradients) and cut into buckets of about `ddp.bucket_size` elements, each
  padded to a multiple of the data-parallel size;
- a post-accumulate-grad hook adds each micro-batch's `param.grad` into the buffer and frees it
  (megatron's `main_grad`); with `overlap_grad_reduce`, a bucket whose parameters have all received
  their last micro-batch's gradient starts its reduction at once (async), while backward goes on;
- `finish()` starts what has not started, waits, divides by the DP size; then sums the TP-partial
  grads (sequence-parallel layer norms, q/k layer norms) over TP and the tied embedding over the
  embedding group, as megatron's `finalize_model_grads` does. Parameters that need those extra sums sit in one bucket of
  their own that is all-reduced (their full gradient is needed), the others are reduce-scattered
  when the optimizer is distributed and all-reduced otherwise.

Distributed optimizer (`DistributedOptimizer`, `ddp.use_distributed_optimizer`, ZeRO-1):
- each DP rank owns the slice `[r·S, (r+1)·S)` of every bucket; for every parameter that overlaps
  its slices it keeps an fp32 main copy of the overlap (a "fragment") and the inner optimizer (AdamW,
  SGD) runs over the fragments only, so optimizer state and main weights take 1/dp of the memory;
- after the step each rank writes its fragments (rounded to the parameter dtype) into a parameter
  buffer the model's parameters are views of, and the buffer is all-gathered bucket by bucket;
  with `overlap_param_gather` the all-gathers run async and each module waits for its own buckets
  in a forward pre-hook, so the gather overlaps the next forward pass;
- grad norm: squares of the own fragments' grads, summed over the DP group, then over TP×PP;
- checkpoints stay canonical: the sharded format writes and reads each rank's fragments as boxes of
  the canonical tensors (`owned_state` / `set_owned_state`, no gather); the other formats use `state`
  (collective: all-gathers the fragments into full parameter-shaped tensors) and `set_param_state`
  (this rank's fragments out of full ones). So a checkpoint saved with the distributed optimizer
  resumes without it, at another DP size, or at another TP/PP layout, and the other way round.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from kubetron.training.grads import (
    counts_toward_norms,
    embedding_group_weight,
    is_expert_parallel,
    model_parallel_grad_sums,
    sum_of_squares,
    summed_over_tp,
)
from kubetron.training.optimizer_base import OptimizerOverCopies, take_main_param

log = logging.getLogger("kubetron")

# torch >= 2.12 names them *_single (the *_tensor names warn); the device machine's torch 2.11 has the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DEFAULT_BUCKET_SIZE = 40_000_000  # elements; megatron's default is max(40M, 1M·dp)


@torch.no_grad()
def broadcast_params(model: list[torch.nn.Module]):
    """Every parameter from the first rank of its data-parallel group (megatron's DDP.broadcast_params):
    with `rng.data_parallel_random_init` each DP rank initialises with its own seed, then the replicas
    become one model; the seeds stay different for dropout."""
    if parallel_state.get_data_parallel_world_size() == 1:
        return
    dense, experts = parallel_state.get_data_parallel_group(), parallel_state.get_expert_data_parallel_group()
    for chunk in model:
        for p in chunk.parameters():
            group = experts if is_expert_parallel(p) else dense  # EP ranks hold other experts
            dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)


def _needs_full_grad(p: torch.nn.Parameter, shared_embedding) -> bool:
    """Parameters whose DP-reduced gradient is summed once more over another group."""
    sp = summed_over_tp(p) and parallel_state.get_tensor_model_parallel_world_size() > 1
    return sp or p is shared_embedding


class _Bucket:
    __slots__ = ("params", "start", "end", "grad", "param_data", "full", "work", "ready", "gather_work")

    def __init__(self, params, start, end, grad, param_data, full):
        self.params, self.start, self.end = params, start, end
        self.grad, self.param_data, self.full = grad, param_data, full
        self.work: dist.Work | None = None  # the pending async reduction
        self.gather_work: dist.Work | None = None  # the pending async param all-gather
        self.ready = 0  # parameters whose last micro-batch's gradient arrived

    def wait_gather(self):
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None

    def shard(self, t: torch.Tensor, rank: int, dp: int) -> torch.Tensor:
        size = (self.end - self.start) // dp
        return t[rank * size:(rank + 1) * size]


class _Buffer:
    """One dtype's parameters: offsets, the gradient buffer, buckets, optionally a parameter buffer."""

    def __init__(self, params, grad_dtype, bucket_size, dp, shared_embedding, with_param_buffer):
        regular = [p for p in params if not _needs_full_grad(p, shared_embedding)]
        special = [p for p in params if _needs_full_grad(p, shared_embedding)]
        plan, offset = [], 0
        for group, full in ((regular, False), (special, True)):
            current, size = [], 0
            for p in group:
                current.append(p)
                size += p.numel()
                if size >= bucket_size:
                    plan.append((current, full))
                    current, size = [], 0
            if current:
                plan.append((current, full))
        self.offsets: dict[torch.nn.Parameter, int] = {}
        spans = []
        for ps, full in plan:
            start = offset
            for p in ps:
                self.offsets[p] = offset
                offset += p.numel()
            offset += (-(offset - start)) % dp  # pad the bucket to a multiple of the DP size
            spans.append((ps, start, offset, full))
        device, dtype = params[0].device, params[0].dtype
        self.grad = torch.zeros(offset, dtype=grad_dtype, device=device)
        self.param_data = None
        if with_param_buffer:
            self.param_data = torch.zeros(offset, dtype=dtype, device=device)
            with torch.no_grad():
                for p in params:
                    view = self.param_data[self.offsets[p]:self.offsets[p] + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view  # the model's parameters now live in the buffer (all-gathered into)
        self.buckets = [_Bucket(ps, s, e, self.grad[s:e],
                                None if self.param_data is None else self.param_data[s:e], full)
                        for ps, s, e, full in spans]

    def grad_view(self, p) -> torch.Tensor:
        o = self.offsets[p]
        return self.grad[o:o + p.numel()].view_as(p)


class GradBuffers:
    """Contiguous, bucketed data-parallel gradients; see the module docstring."""

    def __init__(self, model: list[torch.nn.Module], *, grad_reduce_in_fp32: bool, overlap: bool,
                 num_microbatches: int, bucket_size: int | None, shard: bool):
        self.group = parallel_state.get_data_parallel_group()
        self.dp = parallel_state.get_data_parallel_world_size()
        self.rank = parallel_state.get_data_parallel_rank()
        self.nccl = dist.get_backend(self.group) == "nccl"
        self.overlap, self.shard, self.num_microbatches = overlap, shard, num_microbatches
        self.shared_embedding = shared = embedding_group_weight(model)
        params = []
        for chunk in model:
            params += [p for p in chunk.parameters() if p.requires_grad]
        params.reverse()  # ~ the order backward produces gradients: first buckets are ready first
        by_dtype: dict[torch.dtype, list] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        size = bucket_size or max(DEFAULT_BUCKET_SIZE, 1_000_000 * self.dp)
        self.buffers = [_Buffer(ps, torch.float32 if grad_reduce_in_fp32 else dt, size, self.dp, shared,
                                with_param_buffer=shard)
                        for dt, ps in by_dtype.items()]
        self.buffer_of = {p: b for b in self.buffers for p in b.offsets}
        self.bucket_of = {p: bk for b in self.buffers for bk in b.buckets for p in bk.params}
        self.params = [p for b in self.buffers for p in b.offsets]
        self._counts = {p: 0 for p in self.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    # -- backward ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p: torch.nn.Parameter):
        self.buffer_of[p].grad_view(p).add_(cast(torch.Tensor, p.grad))  # (a grad hook: the grad is there)
        p.grad = None
        self._counts[p] += 1
        if self.overlap and self._counts[p] == self.num_microbatches:
            bucket = self.bucket_of[p]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._start(bucket)

    def _start(self, bucket: _Bucket):
        if bucket.work is not None or self.dp == 1:
            return
        if self.shard and not bucket.full:
            out = bucket.shard(bucket.grad, self.rank, self.dp)
            bucket.work = _reduce_scatter(out, self._input(bucket.grad), group=self.group, async_op=self.overlap)
        else:
            bucket.work = dist.all_reduce(bucket.grad, group=self.group, async_op=self.overlap)

    def _input(self, t: torch.Tensor) -> torch.Tensor:
        """NCCL takes a collective's output aliasing its input (megatron relies on it); for gloo, copy."""
        return t if self.nccl else t.clone()

    def zero(self):
        for b in self.buffers:
            b.grad.zero_()
            for bk in b.buckets:
                bk.work, bk.ready = None, 0
        for p in self.params:
            self._counts[p] = 0
            p.grad = None

    @torch.no_grad()
    def finish(self):
        """DP mean of every bucket (waits for the overlapped ones), then the TP/embedding sums; without
        the distributed optimizer the reduced gradients become `param.grad` again."""
        if self.dp > 1:
            for b in self.buffers:
                for bk in b.buckets:
                    self._start(bk)
                    if self.overlap and bk.work is not None:
                        bk.work.wait()
                    if self.shard and not bk.full:
                        bk.shard(bk.grad, self.rank, self.dp).div_(self.dp)
                    else:
                        bk.grad.div_(self.dp)
        model_parallel_grad_sums(self.params, self.grad_of, self.shared_embedding)
        if not self.shard:
            self.set_param_grads()

    def grad_of(self, p) -> torch.Tensor:
        return self.buffer_of[p].grad_view(p)

    def set_param_grads(self):
        """Non-distributed optimizer: hand the reduced gradients to it as `param.grad` (in the
        parameter's dtype; a view of the buffer when the dtypes agree)."""
        for p in self.params:
            g = self.grad_of(p)
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)


class _Fragment:
    """The part [lo, hi) of a flattened parameter this DP rank owns, with its fp32 main copy."""

    __slots__ = ("param", "lo", "hi", "main", "bucket")

    def __init__(self, param, lo, hi, bucket):
        self.param, self.lo, self.hi, self.bucket = param, lo, hi, bucket
        self.main = torch.nn.Parameter(param.detach().reshape(-1)[lo:hi].float().clone())


class DistributedOptimizer(OptimizerOverCopies):
    """ZeRO-1 over the data-parallel group; see the module docstring (optimizer_base's interface)."""

    grad_sync: GradBuffers  # the buffers it shards over DP

    def __init__(self, model: list[torch.nn.Module], groups: list[dict], make_optimizer, grads: GradBuffers,
                 overlap_param_gather: bool):
        self.grad_sync = grads
        self.params = grads.params
        self.overlap_param_gather = overlap_param_gather
        dp, rank = grads.dp, grads.rank
        self.fragments: list[_Fragment] = []
        group_of = {p: i for i, g in enumerate(groups) for p in g["params"]}
        frag_groups = [{**g, "params": []} for g in groups]
        for buf in grads.buffers:
            for bk in buf.buckets:
                size = (bk.end - bk.start) // dp
                own_lo, own_hi = bk.start + rank * size, bk.start + (rank + 1) * size
                for p in bk.params:
                    ps = buf.offsets[p]
                    lo, hi = max(ps, own_lo), min(ps + p.numel(), own_hi)
                    if lo < hi:
                        f = _Fragment(p, lo - ps, hi - ps, bk)
                        self.fragments.append(f)
                        frag_groups[group_of[p]]["params"].append(f.main)
        if not self.fragments:  # a rank that owns only padding still needs an optimizer to step
            frag_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(0, device=grads.params[0].device)))
        self.inner = make_optimizer(frag_groups)
        self._frags_of: dict[torch.nn.Parameter, list[_Fragment]] = {}
        for f in self.fragments:
            self._frags_of.setdefault(f.param, []).append(f)
        self._gather_pending = False
        self._hooks = []
        if overlap_param_gather:
            owners = {}
            for chunk in model:
                for m in chunk.modules():
                    own = [p for p in m.parameters(recurse=False) if p in grads.bucket_of]
                    if own:
                        owners[m] = {id(grads.bucket_of[p]): grads.bucket_of[p] for p in own}
            for m, buckets in owners.items():
                self._hooks.append(m.register_forward_pre_hook(self._wait_hook(list(buckets.values()))))
        total = sum(p.numel() for p in grads.params)
        own = sum(f.hi - f.lo for f in self.fragments)
        if dist.get_rank() == 0:
            log.info("distributed optimizer: %d buckets over %d data-parallel ranks; this rank keeps optimizer "
                     "state and fp32 main weights for %d of %d parameter elements", sum(len(b.buckets) for b in
                     grads.buffers), dp, own, total)

    # -- what the loop uses (zero_grad, finish_grad_sync, scale_grads: OptimizerOverCopies) ------------
    def _grad_of(self, f: _Fragment) -> torch.Tensor:
        """The reduced gradient of fragment `f` (a view of the gradient buffer)."""
        return self.grad_sync.grad_of(f.param).reshape(-1)[f.lo:f.hi]

    def grad_norm_squared(self) -> torch.Tensor:
        """Sum of squared grads of the fragments this rank owns, summed over the DP group (not yet
        over the model-parallel group: the caller does that, as for the other optimizers)."""
        grads = [self._grad_of(f) for f in self.fragments if counts_toward_norms(f.param)]
        total = sum_of_squares(grads, device=self.grad_sync.params[0].device).reshape(1)
        if self.grad_sync.dp > 1:
            dist.all_reduce(total, group=self.grad_sync.group)
        return total

    @torch.no_grad()
    def step(self):
        self.finish_param_sync()
        main_grads = []
        for f in self.fragments:
            g = self._grad_of(f)
            f.main.grad = main = g if g.dtype == torch.float32 else g.float()
            main_grads.append(main)
        self._apply_grad_scale(main_grads)
        self.inner.step()
        for f in self.fragments:
            f.param.detach().view(-1)[f.lo:f.hi].copy_(f.main)  # into the parameter buffer, rounded
            f.main.grad = None
        self._gather_params(async_op=self.overlap_param_gather)

    def _gather_params(self, async_op: bool):
        gs = self.grad_sync
        if gs.dp == 1:
            return
        for buf in gs.buffers:
            for bk in buf.buckets:
                own = gs._input(bk.shard(bk.param_data, gs.rank, gs.dp))
                bk.gather_work = _all_gather(bk.param_data, own, group=gs.group, async_op=async_op)
                if not async_op:
                    bk.gather_work = None
        self._gather_pending = async_op

    def _wait_hook(self, buckets):
        def hook(module, args):
            for bk in buckets:
                bk.wait_gather()
        return hook

    def finish_param_sync(self):
        """Wait for overlapped parameter all-gathers (before anything reads all parameters)."""
        if not self._gather_pending:
            return
        for buf in self.grad_sync.buffers:
            for bk in buf.buckets:
                bk.wait_gather()
        self._gather_pending = False

    @torch.no_grad()
    def reload_model_params(self):
        """fp32 mains := the model's parameters (after their weights were loaded)."""
        self.finish_param_sync()
        for f in self.fragments:
            f.main.copy_(f.param.detach().reshape(-1)[f.lo:f.hi])

    # -- checkpoints: canonical, parameter-shaped state ---------------------------------------------
    def _state_keys(self) -> list[str]:
        local = sorted({k for f in self.fragments for k, v in self.inner.state.get(f.main, {}).items()
                        if torch.is_tensor(v) and v.ndim > 0})
        if self.grad_sync.dp == 1:
            return local
        everyone: list[Any] = [None] * self.grad_sync.dp  # each rank's keys
        dist.all_gather_object(everyone, local, group=self.grad_sync.group)
        return sorted({k for keys in everyone for k in keys})

    def _step_value(self):
        for f in self.fragments:
            s = self.inner.state.get(f.main, {})
            if "step" in s:
                return s["step"]
        return None

    @property
    @torch.no_grad()
    def state(self) -> dict:
        """{model param: {state key: full tensor, "main_param": fp32 weight, "step"}}.

        Collective over the DP group (every DP rank must read it): each rank contributes its
        fragments, the buckets are all-gathered, and every rank gets full tensors."""
        self.finish_param_sync()
        gs = self.grad_sync
        keys = self._state_keys()
        full: dict[torch.nn.Parameter, dict] = {}
        for key in [*keys, "main_param"]:
            for buf in gs.buffers:
                flat = torch.zeros(buf.grad.numel(), dtype=torch.float32, device=buf.grad.device)
                for f in self.fragments:
                    if gs.buffer_of[f.param] is buf:
                        src = f.main if key == "main_param" else self.inner.state.get(f.main, {}).get(key)
                        if src is not None:
                            o = buf.offsets[f.param]
                            flat[o + f.lo:o + f.hi].copy_(src.reshape(-1))
                if gs.dp > 1:
                    for bk in buf.buckets:
                        piece = flat[bk.start:bk.end]
                        _all_gather(piece, gs._input(bk.shard(piece, gs.rank, gs.dp)), group=gs.group)
                for p, o in buf.offsets.items():
                    full.setdefault(p, {})[key] = flat[o:o + p.numel()].view(p.shape)
        step = self._step_value()
        if keys and step is not None:
            for entry in full.values():
                entry["step"] = step.clone()
        return full

    @torch.no_grad()
    def set_param_state(self, model_param: torch.nn.Parameter, state: dict):
        """Restore one parameter from full (canonical) state: this rank takes its fragments."""
        state, saved_main = take_main_param(model_param, state)
        for f in self._frags_of.get(model_param, []):
            self._restore_fragment(f, None if saved_main is None else saved_main.reshape(-1)[f.lo:f.hi],
                                   {k: v.reshape(-1)[f.lo:f.hi] if torch.is_tensor(v) and v.ndim > 0 else v
                                    for k, v in state.items()})

    def owned_ranges(self) -> list[tuple[torch.nn.Parameter, int, int]]:
        return [(f.param, f.lo, f.hi) for f in self.fragments]

    def owned_state(self) -> list[tuple[torch.nn.Parameter, int, int, dict]]:
        """Each fragment's inner state and, for a bf16/fp16 parameter, its fp32 main, as they are (no
        gather: sharded checkpoints). An fp32 parameter is its main, bit for bit: the model's copy is saved."""
        self.finish_param_sync()
        return [(f.param, f.lo, f.hi, {**({"main_param": f.main.detach()} if f.param.dtype != torch.float32 else {}),
                                       **self.inner.state.get(f.main, {})})
                for f in self.fragments]

    @torch.no_grad()
    def set_owned_state(self, model_param: torch.nn.Parameter, lo: int, hi: int, state: dict):
        """Restore one fragment from the state of exactly its range (a saved main becomes its fp32 main)."""
        f = next((f for f in self._frags_of.get(model_param, []) if (f.lo, f.hi) == (lo, hi)), None)
        if f is None:
            raise ValueError(f"this rank owns no range [{lo}, {hi}) of a parameter of shape {list(model_param.shape)}")
        state = dict(state)
        self._restore_fragment(f, state.pop("main_param", None), state)

    def _restore_fragment(self, f: _Fragment, main: torch.Tensor | None, state: dict):
        """Fragment `f`'s fp32 main (None: from the model's weight) and inner state (flat tensors of its
        range; tensors are copied, so no two fragments share a `step`)."""
        f.main.copy_(main if main is not None else f.param.detach().reshape(-1)[f.lo:f.hi])
        entry = {k: (v.to(f.main.device, copy=True) if v.ndim > 0 else v.clone()) if torch.is_tensor(v) else v
                 for k, v in state.items()}
        if entry:
            self.inner.state[f.main] = entry
        else:
            self.inner.state.pop(f.main, None)

    def state_dict(self) -> dict:
        """This rank's own shard (same-layout resumes only: node-local checkpoints)."""
        return {"inner": self.inner.state_dict(), "main_params": [f.main.detach() for f in self.fragments]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        self.inner.load_state_dict(sd["inner"])
        mains = sd["main_params"]
        if len(mains) != len(self.fragments):
            raise ValueError(f"state dict has {len(mains)} main fragments, this optimizer {len(self.fragments)}")
        for f, saved in zip(self.fragments, mains, strict=True):
            f.main.copy_(saved)
            f.param.detach().view(-1)[f.lo:f.hi].copy_(f.main)
        self._gather_params(async_op=False)
