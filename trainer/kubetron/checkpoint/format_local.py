"""Non-persistent "local" checkpoints (checkpoint.non_persistent_ckpt_type local): every rank writes its own
`state.pt` (its model chunk, optimizer, common state, RNG) to its node-local directory
`<non_persistent_local_ckpt_dir>/rank_NNNNN/iter_N/`; resumable at the same layout only."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from kubetron.checkpoint import comm
from kubetron.checkpoint.layout import TENSOR_DTYPES, brief, committed_iterations, iter_dir, safe_load
from kubetron.contract.errors import CheckpointError
from kubetron.contract.times import stamp
from kubetron.storage import open_store

STATE = "state.pt"


def open_local_store(directory: str, rank: int):
    """This rank's own directory under checkpoint.non_persistent_local_ckpt_dir."""
    return open_store(f"{directory.rstrip('/')}/rank_{rank:05d}")


def model_state(chunk) -> dict:
    """The chunk's own tensors on the host (no gather: the same layout loads them)."""
    return {k: v.detach().cpu() for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}


def write(store, step: int, state: dict, rank: int):
    """`state` as iter_N/state.pt, committed; older local checkpoints of this rank are removed."""
    txn = store.begin_dir(iter_dir(step), primary=True)
    try:
        with txn.open_write(STATE) as f:
            torch.save(state, f)
        txn.commit(json.dumps({"iteration": step, "time": stamp(), "rank": rank}).encode())
    except Exception:
        txn.abort()
        raise
    for it in committed_iterations(store):  # keep only the newest
        if it != step:
            store.delete_prefix(iter_dir(it) + "/")


def agreed_iteration(store) -> int | None:
    """Collective: the newest local checkpoint that every rank has (same layout), or None."""
    mine = -1
    if store is not None:
        its = committed_iterations(store)
        mine = its[-1] if its else -1
    t = torch.tensor([mine], dtype=torch.int64, device=comm.collective_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item()) if t.item() >= 0 else None


def read(store, iteration: int) -> tuple[str, dict]:
    """(key, state) of this rank's local checkpoint at `iteration`."""
    key = f"{iter_dir(iteration)}/{STATE}"
    with store.open_read(key) as f:
        return key, safe_load(f, key)


def load_model(chunk, weights: dict, key: str):
    """The saved chunk's tensors into `chunk`; they must match it exactly (tensors of its shapes)."""
    own = chunk.state_dict()
    if not isinstance(weights, dict):
        raise CheckpointError(f"local checkpoint {key} holds no model tensors")
    for k, v in weights.items():
        if k in own and not (torch.is_tensor(v) and v.shape == own[k].shape and v.dtype in TENSOR_DTYPES.values()):
            raise CheckpointError(f"local checkpoint {key}: {brief(k)} is not a tensor of this model's shape "
                                  f"{list(own[k].shape)}")
    missing, unexpected = chunk.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"local checkpoint {key} does not match the model: {missing[:3]} {unexpected[:3]}")
