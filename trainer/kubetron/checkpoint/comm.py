"""Small collectives the loop and the checkpointer share, on the device the process group needs.

NCCL takes only CUDA tensors and gloo only host tensors (for most ops), so a flag or a counter sent
through a collective must live on the device of the group's backend: `collective_device(group)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """The device a tensor must be on for a collective over `group` (None: the default group)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank of `group` if it is True on any (so all ranks stop at the same iteration)."""
    if _world(group) == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def all_ranks(flag: bool, group=None) -> bool:
    """True on every rank of `group` only if it is True on all of them."""
    return not any_rank(not flag, group)
