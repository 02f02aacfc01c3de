"""The host copy: a snapshot's tensors copied into host buffers reused from save to save.

The copy itself is `kubetron.checkpoint._hostcopy` (_hostcopy.c, built by setup.py, optional): it streams
the bytes past the caches; without it, ctypes.memmove (the same bytes, 1.4-1.6x the blocked time).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import torch

try:  # the compiled snapshot copy (setup.py); absent where the install had no C compiler
    from kubetron.checkpoint import _hostcopy  # type: ignore[attr-defined]  # a C extension: no stub
except ImportError:  # tests set it to None to run the fallback
    _hostcopy = None


def copy_impl() -> str:
    """Which copy `copy_host` uses: "nontemporal" (kubetron.checkpoint._hostcopy on x86-64), "memcpy"
    (kubetron.checkpoint._hostcopy elsewhere) or "ctypes.memmove" (the extension was not built)."""
    if _hostcopy is None:
        return "ctypes.memmove"
    return "nontemporal" if _hostcopy.NONTEMPORAL else "memcpy"


def copy_host(items: list[tuple[int, int, int]]) -> None:
    """Copy each (dst_address, src_address, nbytes) between host memory ranges that do not overlap.

    The snapshot's copy: kubetron.checkpoint._hostcopy streams the bytes past the caches (the buffers are read
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
        queued: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        self._queued = queued
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
