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

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from kubetron.checkpoint.hostcopy import HostBuffers
from kubetron.checkpoint.layout import TENSOR_DTYPES, brief
from kubetron.contract.errors import CheckpointError

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT_RE = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_TIED_OUTPUT = "output_layer.weight"
WORD_EMBEDDING = "embedding.word_embeddings.weight"


def _sizes() -> tuple[int, int]:
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())


def _skip(name: str) -> bool:
    return name.endswith("_extra_state")


def is_tied_output_copy(chunk, name: str) -> bool:
    """The last stage's copy of the word embedding under PP (not part of the canonical model)."""
    return (name == _TIED_OUTPUT and getattr(chunk, "share_embeddings_and_output_weights", False)
            and not getattr(chunk, "pre_process", True))


@dataclass(frozen=True)
class Offsets:
    """Local -> global numbering of this rank's parts: `layers` maps a stage's layer index to the global
    one (0-based, PP); `experts` is the global index of this rank's first local expert (EP)."""

    layers: dict[int, int]
    experts: int = 0


def layer_offsets(chunk) -> Offsets:
    """This stage's layer numbering and this EP rank's expert numbering."""
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None) or []
    num_experts = getattr(getattr(chunk, "config", None), "num_moe_experts", None) or 0
    ep = parallel_state.get_expert_model_parallel_world_size() if num_experts else 1
    first = parallel_state.get_expert_model_parallel_rank() * (num_experts // ep) if ep > 1 else 0
    return Offsets({i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}, first)


def canonical_name(name: str, offsets: Offsets) -> str:
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


def is_gated_fc1(chunk, name: str) -> bool:
    """fc1's output rows are [gate; up] (its weight, bias, and a LoRA adapter's B, not its A)."""
    cfg = getattr(chunk, "config", None)
    return (bool(getattr(cfg, "gated_linear_unit", False)) and ".mlp." in f".{name}"  # experts' fc1 too
            and ".linear_fc1." in f".{name}" and ".adapter.linear_in." not in name)


def tp_split(param) -> int | None:
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
           if tp_split(params.get(k)) is None}
    split = {k: dim for k in tensors if (dim := tp_split(params.get(k))) is not None}  # name -> split dim
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
        dim = split[k]
        if is_gated_fc1(chunk, k):
            halves = [s.chunk(2, dim=0) for s in shards]
            out[k] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            out[k] = torch.cat(shards, dim=dim)
    return out


def _slice_tp(chunk, name: str, full: torch.Tensor, local_shape) -> torch.Tensor:
    """This TP rank's part of the canonical tensor `full` for the local tensor `name`."""
    if not torch.is_tensor(full) or full.dtype not in TENSOR_DTYPES.values():
        got = full.dtype if torch.is_tensor(full) else type(full).__name__
        raise CheckpointError(f"{name}: the checkpoint holds {got}, not a tensor kubetron loads")
    param = dict(chunk.named_parameters()).get(name)
    dim = tp_split(param)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if dim is None or tp == 1:
        out = full
    else:
        r = parallel_state.get_tensor_model_parallel_rank()
        if is_gated_fc1(chunk, name):
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
    gathered: list[Any] | None = [None] * pp if is_dst else None
    dist.gather_object(obj, gathered, dst=dst, group=group)
    if gathered is None:  # (not the destination)
        return {}
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return merged


def _participates() -> bool:
    """Only the data-parallel rank 0 replica gathers (TP and PP groups never span DP ranks)."""
    return parallel_state.get_data_parallel_rank() == 0


# --- model -----------------------------------------------------------------------------------------

def local_state(chunk, keep=None) -> dict[str, torch.Tensor]:
    """The chunk's tensors; `keep(name)` selects some (LoRA: base or adapter tensors)."""
    return {k: v for k, v in chunk.state_dict().items() if not _skip(k) and (keep is None or keep(k))}


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def gather_model_state(model: list[torch.nn.Module], buffers: HostBuffers) -> dict[str, torch.Tensor]:
    """Full tensors on the host, keyed by canonical name (only global rank 0's result is complete)."""
    chunk = model[0]
    tp, pp = _sizes()
    own = local_state(chunk)
    if tp == 1 and pp == 1:  # data parallel only: rank 0's replica is the whole model
        return {k: buffers.copy(f"model/{k}", v) for k, v in own.items()} if _global_rank() == 0 else {}
    if not _participates():
        return {}
    own = {k: v for k, v in own.items() if not is_tied_output_copy(chunk, k)}
    full = _gather_tp(chunk, own)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return {}  # the PP group of TP rank r holds only TP rank r of each stage: all of it skips
    offsets = layer_offsets(chunk)
    return _gather_pp({canonical_name(k, offsets): v for k, v in full.items()})


def source_name(chunk, name: str, offsets) -> str:
    return WORD_EMBEDDING if is_tied_output_copy(chunk, name) else canonical_name(name, offsets)


def _held_elsewhere(chunk, name: str, pp: int) -> bool:
    """A canonical tensor another rank of this model holds: another stage's (PP), or another EP rank's expert;
    a layer or an expert number beyond the model's is no rank's."""
    m = _LAYER_RE.match(name)
    if m is None or int(m.group(1)) >= int(getattr(chunk.config, "num_layers", 0)):
        return m is None and pp > 1
    if e := _LOCAL_EXPERT_RE.match(m.group(2)):
        return int(e.group(2)) < (getattr(chunk.config, "num_moe_experts", None) or 0)
    return pp > 1


def load_model_state(model: list[torch.nn.Module], full: Mapping[str, torch.Tensor], keep=None):
    """Copy this rank's part of the canonical tensors into its parameters (`keep(name)`: only some)."""
    chunk = model[0]
    pp = _sizes()[1]
    own = local_state(chunk, keep)
    offsets = layer_offsets(chunk)
    wanted = {k: source_name(chunk, k, offsets) for k in own}
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
    """Optimizer state (keyed by parameter name, see optimizer_state_by_name) in
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
    names = [n for n in params if n in states and not is_tied_output_copy(chunk, n)]
    # One gather per state key, same order on every TP rank (same parameters, same optimizer).
    keys = sorted({k for n in names for k, v in states[n].items() if _is_param_shaped(v, params[n])})
    gathered = {k: _gather_tp(chunk, {n: states[n][k] for n in names if _is_param_shaped(states[n].get(k), params[n])})
                for k in keys}
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return {}
    offsets = layer_offsets(chunk)
    out: dict = {}
    for n in names:
        entry = {}
        for k, v in states[n].items():
            if k in gathered and n in gathered[k]:
                entry[k] = gathered[k][n]
            else:
                entry[k] = v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
        out[canonical_name(n, offsets)] = entry
    return {"state": _gather_pp(out), "param_groups": by_name["param_groups"]}


def scatter_optimizer_state(model, saved: dict) -> dict:
    """This rank's share of a canonical optimizer state, keyed by local parameter name."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or "param_groups" not in saved:
        raise CheckpointError(f"the optimizer state is not kubetron's ({brief(saved)})")
    chunk = model[0]
    tp, pp = _sizes()
    offsets = layer_offsets(chunk)
    if tp == 1 and pp == 1 and not offsets.experts \
            and not any(is_tied_output_copy(chunk, n) for n, _ in chunk.named_parameters()):
        return saved  # local names are the canonical ones
    state = {}
    for name, param in chunk.named_parameters():
        src = saved["state"].get(source_name(chunk, name, offsets))
        if src is None:
            continue
        if not isinstance(src, dict):
            raise CheckpointError(f"optimizer state of {name} is {type(src).__name__}, not a dict")
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


def _hyper(v) -> bool:
    """A hyperparameter value an optimizer's param group holds (lr, betas, weight_decay, flags, names)."""
    if isinstance(v, (tuple, list)):
        return len(v) <= 8 and all(v_ is None or type(v_) in (bool, int, float) for v_ in v)
    return v is None or type(v) in (bool, int, float, str) or (torch.is_tensor(v) and v.numel() == 1)


def _restore_param_groups(optimizer, saved_groups: list[dict]):
    """The saved hyperparameters into the live param groups; a checkpoint's groups are hostile input, so
    each is a dict of plain values, keyed by the names the live group has (others are left out)."""
    if not isinstance(saved_groups, list) or not all(isinstance(sg, dict) for sg in saved_groups):
        raise CheckpointError(f"the optimizer's param groups are not a list of dicts ({brief(saved_groups)})")
    for g, sg in zip(optimizer.param_groups, saved_groups):
        for k, v in sg.items():
            if k == "params" or k not in g:
                continue
            if not _hyper(v):
                raise CheckpointError(f"optimizer param group {brief(k)} = {brief(v)} is not a hyperparameter")
            g[k] = v


def check_param_state(name: str, state, param) -> dict:
    """One parameter's saved optimizer state: a dict of known state names whose tensors are the
    parameter's shape (or 0-d, `step`) and whose other values are plain numbers."""
    if not isinstance(state, dict):
        raise CheckpointError(f"optimizer state of {name} is {type(state).__name__}, not a dict")
    for k, v in state.items():
        if torch.is_tensor(v):
            ok = v.dtype in TENSOR_DTYPES.values() and (v.ndim == 0 or v.numel() == param.numel())
        else:
            ok = v is None or type(v) in (bool, int, float)
        if not isinstance(k, str) or not ok:
            got = list(v.shape) if torch.is_tensor(v) else brief(v)
            raise CheckpointError(f"optimizer state {brief(k)} of {name} is not param-shaped state ({got}; the "
                                  f"parameter has {param.numel()} elements)")
    return state


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
            raise CheckpointError(f"optimizer state has a parameter this model lacks: {brief(name)}")
        optimizer.set_param_state(p, _state_on(device, optimizer, check_param_state(name, s, p)))
    _restore_param_groups(optimizer, saved["param_groups"])


def load_owned_optimizer_state(optimizer, owned: list[tuple], param_groups: list[dict], device):
    """Restore a DP-sharded optimizer from the state of the ranges it owns (format_sharded.load_owned)."""
    for p, lo, hi, state in owned:
        optimizer.set_owned_state(p, lo, hi, _state_on(device, optimizer, state))
    _restore_param_groups(optimizer, param_groups)
