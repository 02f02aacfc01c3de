"""Canonical (layout-free) checkpoint tensors: gather from this rank's shards, scatter back.

Canonical form = the state dict a TP=1, PP=1 model has: full tensors under its names, global layer
numbers. A checkpoint saved at any (DP, TP, PP) therefore loads at any other, as long as the model
itself is the same (the architecture fields in common.pt, the padded vocabulary included).

Gather (save). Only the data-parallel rank 0 replica takes part (the other replicas hold the same
values). Within it:
- TP: every tensor-parallel parameter (megatron sets `param.tensor_model_parallel` and
  `param.partition_dim`) is all-gathered over the TP group (one flat all-gather) and concatenated
  along `partition_dim`. Two layouts need more than a concatenation:
  * SwiGLU `mlp.linear_fc1` (`gated_linear_unit`): each TP rank holds `[gate_r; up_r]`, the full
    tensor is `[gate_0; gate_1; ...; up_0; up_1; ...]`, so each shard is split in halves first;
  * vocabulary-parallel embedding/output layer: split along dim 0 over the *padded* vocabulary,
    which plain concatenation restores (the padding depends on TP: see docs/parallelism.md).
  The fused QKV weight is grouped by query group, so TP's contiguous split is a plain concatenation.
- PP: layer numbers in the state dict are local to the stage (`decoder.layers.0` on every stage);
  they become global through each layer's `layer_number` (1-based, global). The last stage's copy
  of a tied word embedding (`output_layer.weight`, marked `shared`) is not saved: the canonical
  model has no such tensor. The stages' dicts are gathered onto the first stage
  (`gather_object` over the pipeline group), so global rank 0 ends up with the whole model.
Scatter (load). Every rank reads the canonical file and takes its part: the slice of its TP rank
along `partition_dim` (re-interleaving gated fc1), its stage's layers, and for the last stage's tied
output weight, the word embedding.

Optimizer state is converted the same way, tensor by tensor: a state tensor with the parameter's
shape (Adam's `exp_avg`, `exp_avg_sq`, SGD's `momentum_buffer`) is gathered/sliced like the
parameter; anything else (`step`) is copied.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

try:  # the compiled snapshot copy (setup.py); absent where the install had no C compiler
    from kubetron import _hostcopy
except ImportError:  # tests set it to None to run the fallback
    _hostcopy = None

from kubetron.contract.errors import CheckpointError

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT_RE = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_TIED_OUTPUT = "output_layer.weight"
_WORD_EMBEDDING = "embedding.word_embeddings.weight"


def _sizes() -> tuple[int, int]:
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())


def _skip(name: str) -> bool:
    return name.endswith("_extra_state")


def _is_tied_output_copy(chunk, name: str) -> bool:
    """The last stage's copy of the word embedding under PP (not part of the canonical model)."""
    return (name == _TIED_OUTPUT and getattr(chunk, "share_embeddings_and_output_weights", False)
            and not getattr(chunk, "pre_process", True))


@dataclass(frozen=True)
class Offsets:
    """Local -> global numbering of this rank's parts: `layers` maps a stage's layer index to the global
    one (0-based, PP); `experts` is the global index of this rank's first local expert (EP)."""

    layers: dict[int, int]
    experts: int = 0


def _layer_offsets(chunk) -> Offsets:
    """This stage's layer numbering and this EP rank's expert numbering."""
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None) or []
    num_experts = getattr(getattr(chunk, "config", None), "num_moe_experts", None) or 0
    ep = parallel_state.get_expert_model_parallel_world_size() if num_experts else 1
    first = parallel_state.get_expert_model_parallel_rank() * (num_experts // ep) if ep > 1 else 0
    return Offsets({i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}, first)


def _canonical_name(name: str, offsets: Offsets) -> str:
    """The name in a TP=1/PP=1/EP=1 model: global layer number, global expert number."""
    m = _LAYER_RE.match(name)
    if not m:
        return name
    rest = m.group(2)
    if g := _GROUPED_EXPERT_RE.match(rest):  # TE's grouped experts: the local spec's names, one per expert
        rest = f"mlp.experts.local_experts.{g.group(3)}.{g.group(1)}.{g.group(2)}"
    if offsets.experts and (e := _LOCAL_EXPERT_RE.match(rest)):
        rest = f"{e.group(1)}{int(e.group(2)) + offsets.experts}{e.group(3)}"
    return f"decoder.layers.{offsets.layers[int(m.group(1))]}.{rest}"


def is_expert(name: str) -> bool:
    """A routed expert's tensor (SequentialMLP's local_experts, TE's grouped experts), adapters included."""
    return ".mlp.experts." in f".{name}"


def _is_gated_fc1(chunk, name: str) -> bool:
    """fc1's output rows are [gate; up] (its weight, bias, and a LoRA adapter's B, not its A)."""
    cfg = getattr(chunk, "config", None)
    return (bool(getattr(cfg, "gated_linear_unit", False)) and ".mlp." in f".{name}"  # experts' fc1 too
            and ".linear_fc1." in f".{name}" and ".adapter.linear_in." not in name)


def _tp_split(param) -> int | None:
    """partition_dim of a TP-split parameter, None for a replicated one."""
    if param is not None and getattr(param, "tensor_model_parallel", False):
        return int(getattr(param, "partition_dim", 0))
    return None


# --- TP --------------------------------------------------------------------------------------------

def _gather_tp(chunk, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors for `tensors` (keyed by local parameter/state-dict name), on the host."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    params = dict(chunk.named_parameters())
    out = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()
           if _tp_split(params.get(k)) is None}
    split = [k for k in tensors if _tp_split(params.get(k)) is not None]
    if not split:
        return out
    if tp == 1:
        out.update({k: tensors[k].detach().to("cpu", copy=True) for k in split})
        return out
    local = [tensors[k].detach() for k in split]
    flat = torch.cat([t.reshape(-1).float() for t in local])  # fp32 holds bf16/fp16 values exactly
    parts = [torch.empty_like(flat) for _ in range(tp)]
    dist.all_gather(parts, flat.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    parts = [p.cpu() for p in parts]
    pos = 0
    for k, t in zip(split, local, strict=True):
        n = t.numel()
        shards = [p[pos:pos + n].view(t.shape).to(t.dtype) for p in parts]
        pos += n
        dim = _tp_split(params[k])
        if _is_gated_fc1(chunk, k):
            halves = [s.chunk(2, dim=0) for s in shards]
            out[k] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            out[k] = torch.cat(shards, dim=dim)
    return out


def _slice_tp(chunk, name: str, full: torch.Tensor, local_shape) -> torch.Tensor:
    """This TP rank's part of the canonical tensor `full` for the local tensor `name`."""
    param = dict(chunk.named_parameters()).get(name)
    dim = _tp_split(param)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if dim is None or tp == 1:
        out = full
    else:
        r = parallel_state.get_tensor_model_parallel_rank()
        if _is_gated_fc1(chunk, name):
            gate, up = full.chunk(2, dim=0)
            out = torch.cat([gate.chunk(tp, dim=0)[r], up.chunk(tp, dim=0)[r]], dim=0)
        else:
            if full.shape[dim] % tp:
                raise CheckpointError(f"{name}: dimension {dim} of size {full.shape[dim]} does not split "
                                      f"over {tp} tensor-parallel ranks")
            out = full.chunk(tp, dim=dim)[r]
    if tuple(out.shape) != tuple(local_shape):
        raise CheckpointError(f"{name}: checkpoint shape {tuple(full.shape)} does not give this rank's shape "
                              f"{tuple(local_shape)} (tp={tp})")
    return out


# --- PP --------------------------------------------------------------------------------------------

def _gather_pp(obj: dict) -> dict:
    """Merge the stages' canonical dicts on the first stage of each pipeline (others get {})."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return obj
    group = parallel_state.get_pipeline_model_parallel_group()
    dst = parallel_state.get_pipeline_model_parallel_first_rank()
    is_dst = dist.get_rank() == dst
    gathered = [None] * pp if is_dst else None
    dist.gather_object(obj, gathered, dst=dst, group=group)
    if not is_dst:
        return {}
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return merged


def _participates() -> bool:
    """Only the data-parallel rank 0 replica gathers (TP and PP groups never span DP ranks)."""
    return parallel_state.get_data_parallel_rank() == 0


# --- model -----------------------------------------------------------------------------------------

def _local_state(chunk, keep=None) -> dict[str, torch.Tensor]:
    """The chunk's tensors; `keep(name)` selects some (LoRA: base or adapter tensors)."""
    return {k: v for k, v in chunk.state_dict().items() if not _skip(k) and (keep is None or keep(k))}


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def copy_impl() -> str:
    """Which copy `copy_host` uses: "nontemporal" (kubetron._hostcopy on x86-64), "memcpy"
    (kubetron._hostcopy elsewhere) or "ctypes.memmove" (the extension was not built)."""
    if _hostcopy is None:
        return "ctypes.memmove"
    return "nontemporal" if _hostcopy.NONTEMPORAL else "memcpy"


def copy_host(items: list[tuple[int, int, int]]) -> None:
    """Copy each (dst_address, src_address, nbytes) between host memory ranges that do not overlap.

    The snapshot's copy: kubetron._hostcopy streams the bytes past the caches (the buffers are read
    again only by the background writer), 1.4-1.7x libc's speed in a snapshot; one call for all
    pieces, the GIL released. Without the extension, one ctypes.memmove per piece: the same bytes."""
    if _hostcopy is not None:
        _hostcopy.copy_many(items)
        return
    for dst, src, n in items:
        ctypes.memmove(dst, src, n)


class HostBuffers:
    """Host memory a snapshot is copied into, reused from one save to the next (owned by a
    CheckpointManager).

    Allocating fresh host memory for a large snapshot costs seconds; an async save should block the
    loop only for the copy. Safe because a new snapshot is taken only after the previous save finished
    (CheckpointManager.save finalizes first). The caller synchronizes the device once after all copies.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._queued: list[tuple[torch.Tensor, torch.Tensor, int, int]] | None = None

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Inside the block a copy from a contiguous CPU tensor (`copy_range`, `copy`) is only queued; they
        all run, back to back, when the block ends (none if it raises). Python work between copies of MBs
        runs on caches those copies just flushed: ~12 us a piece, 2.5 ms of a 15 ms snapshot of 200
        pieces (bench/checkpoint.py)."""
        self._queued = queued = []
        try:
            yield
        finally:
            self._queued = None
        copy_host([(buf.data_ptr(), src.data_ptr() + offset, n) for buf, src, offset, n in queued])

    def _buffer(self, key: str, shape, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        return buf

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """`t` copied to host memory, into the buffer this key used at the previous save (a contiguous CPU
        tensor through copy_range: queued inside `batch()`)."""
        t = t.detach()
        if t.is_cpu and t.is_contiguous():  # copy_host: 1.4-1.7x libc's and torch's CPU copy
            return self.copy_range(key, t, 0, tuple(t.shape))
        buf = self._buffer(key, t.shape, t.dtype, t.is_cuda)
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf

    def copy_range(self, key: str, t: torch.Tensor, first: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Elements [first, first + prod(shape)) of the contiguous CPU tensor `t`, as `shape`, copied
        into the buffer this key used at the previous save."""
        buf = self._buffer(key, shape, t.dtype, False)
        size = t.element_size()
        n = buf.numel() * size
        if first < 0 or first * size + n > t.numel() * size:
            raise ValueError(f"{key}: elements {first}..{first + buf.numel()} outside a tensor of {t.numel()}")
        if n and self._queued is not None:
            self._queued.append((buf, t, first * size, n))  # holds `t`: its memory stays valid until the copy
        elif n:
            copy_host([(buf.data_ptr(), t.data_ptr() + first * size, n)])
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def gather_model_state(model: list[torch.nn.Module], buffers: HostBuffers) -> dict[str, torch.Tensor]:
    """Full tensors on the host, keyed by canonical name (only global rank 0's result is complete)."""
    chunk = model[0]
    tp, pp = _sizes()
    own = _local_state(chunk)
    if tp == 1 and pp == 1:  # data parallel only: rank 0's replica is the whole model
        return {k: buffers.copy(f"model/{k}", v) for k, v in own.items()} if _global_rank() == 0 else {}
    if not _participates():
        return {}
    own = {k: v for k, v in own.items() if not _is_tied_output_copy(chunk, k)}
    full = _gather_tp(chunk, own)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return {}  # the PP group of TP rank r holds only TP rank r of each stage: all of it skips
    offsets = _layer_offsets(chunk)
    return _gather_pp({_canonical_name(k, offsets): v for k, v in full.items()})


def _source_name(chunk, name: str, offsets) -> str:
    return _WORD_EMBEDDING if _is_tied_output_copy(chunk, name) else _canonical_name(name, offsets)


def _held_elsewhere(chunk, name: str, pp: int) -> bool:
    """A canonical tensor another rank of this model holds: another stage's (PP), or another EP rank's expert;
    a layer or an expert number beyond the model's is no rank's."""
    m = _LAYER_RE.match(name)
    if m is None or int(m.group(1)) >= int(getattr(chunk.config, "num_layers", 0)):
        return m is None and pp > 1
    if e := _LOCAL_EXPERT_RE.match(m.group(2)):
        return int(e.group(2)) < (getattr(chunk.config, "num_moe_experts", None) or 0)
    return pp > 1


def load_model_state(model: list[torch.nn.Module], full: dict[str, torch.Tensor], keep=None):
    """Copy this rank's part of the canonical tensors into its parameters (`keep(name)`: only some)."""
    chunk = model[0]
    pp = _sizes()[1]
    own = _local_state(chunk, keep)
    offsets = _layer_offsets(chunk)
    wanted = {k: _source_name(chunk, k, offsets) for k in own}
    missing = sorted(v for v in wanted.values() if v not in full)
    unexpected = sorted(k for k in set(full) - set(wanted.values()) if not _held_elsewhere(chunk, k, pp))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint tensors do not match the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        for k, t in own.items():
            src = _slice_tp(chunk, k, full[wanted[k]], t.shape)
            t.copy_(src.to(t.dtype))


# --- optimizer -------------------------------------------------------------------------------------

def _is_param_shaped(v, param) -> bool:
    return torch.is_tensor(v) and param is not None and tuple(v.shape) == tuple(param.shape) and v.ndim > 0


def gather_optimizer_state(model, by_name: dict, buffers: HostBuffers) -> dict:
    """Optimizer state (keyed by parameter name, see checkpointing.optimizer_state_by_name) in
    canonical form on the host."""
    chunk = model[0]
    tp, pp = _sizes()
    states = by_name["state"]
    if tp == 1 and pp == 1:
        if _global_rank() != 0:
            return {}
        state = {n: {k: (buffers.copy(f"optim/{n}/{k}", v) if torch.is_tensor(v) else v) for k, v in s.items()}
                 for n, s in states.items()}
        return {"state": state, "param_groups": by_name["param_groups"]}
    if not _participates():
        return {}
    params = dict(chunk.named_parameters())
    names = [n for n in params if n in states and not _is_tied_output_copy(chunk, n)]
    # One gather per state key, same order on every TP rank (same parameters, same optimizer).
    keys = sorted({k for n in names for k, v in states[n].items() if _is_param_shaped(v, params[n])})
    gathered = {k: _gather_tp(chunk, {n: states[n][k] for n in names if _is_param_shaped(states[n].get(k), params[n])})
                for k in keys}
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return {}
    offsets = _layer_offsets(chunk)
    out: dict = {}
    for n in names:
        entry = {}
        for k, v in states[n].items():
            if k in gathered and n in gathered[k]:
                entry[k] = gathered[k][n]
            else:
                entry[k] = v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
        out[_canonical_name(n, offsets)] = entry
    return {"state": _gather_pp(out), "param_groups": by_name["param_groups"]}


def scatter_optimizer_state(model, saved: dict) -> dict:
    """This rank's share of a canonical optimizer state, keyed by local parameter name."""
    chunk = model[0]
    tp, pp = _sizes()
    offsets = _layer_offsets(chunk)
    if tp == 1 and pp == 1 and not offsets.experts \
            and not any(_is_tied_output_copy(chunk, n) for n, _ in chunk.named_parameters()):
        return saved  # local names are the canonical ones
    state = {}
    for name, param in chunk.named_parameters():
        src = saved["state"].get(_source_name(chunk, name, offsets))
        if src is None:
            continue
        entry = {}
        for k, v in src.items():
            if torch.is_tensor(v) and v.ndim > 0:  # param-shaped state: sliced like the parameter
                entry[k] = _slice_tp(chunk, name, v, param.shape).clone()
            elif torch.is_tensor(v):
                entry[k] = v.clone()
            else:
                entry[k] = v
        state[name] = entry
    return {"state": state, "param_groups": saved["param_groups"]}
