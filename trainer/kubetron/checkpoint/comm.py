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


def all_gather_bytes(data: bytes, group=None) -> list[bytes]:
    """Every rank's `data` (of any length), in rank order, on every rank of `group`."""
    world = _world(group)
    if world == 1:
        return [data]
    device = collective_device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(parts, mine.to(device), group=group)
    return [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, lengths, strict=True)]


def exchange_bytes(inp: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group=None) -> list[torch.Tensor]:
    """All-to-all of bytes: `inp` (a flat uint8 CPU tensor) holds for each rank j in turn `send_sizes[j]` bytes
    for it; returns what each rank sent this one, `recv_sizes[q]` bytes from rank q (both sides must agree on the
    sizes). The caller fills `inp` in place (a gang's reads go straight into it)."""
    world = _world(group)
    if world == 1:
        return [inp]
    device = collective_device(group)
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, inp.to(device), output_split_sizes=list(recv_sizes),
                           input_split_sizes=list(send_sizes), group=group)
    return list(out.cpu().split(list(recv_sizes)))
