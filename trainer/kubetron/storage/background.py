"""Async checkpoint saves: the training loop blocks only to snapshot state to host memory.

    saver = AsyncSaver()
    snapshot = ...                                   # CPU copies, taken in the loop (the only blocking part)
    saver.schedule(lambda: write_checkpoint(snapshot),   # background: torch.save + upload/fsync + commit
                   lambda: move_tracker_log_and_prune())  # caller's thread, only after fn succeeded
    ...
    saver.maybe_finalize()                 # every iteration: runs finalize_fn of finished saves, in order
    saver.maybe_finalize(blocking=True)    # before exit / on SIGTERM: wait for all, finalize them
    saver.close()

Why a thread and not a process: the work is file/socket I/O (fsync, HTTP part uploads) and torch
serialization of CPU tensors, all of which release the GIL, so one worker thread overlaps with the
training loop without pickling a GB-sized snapshot across a process boundary (a process would need the
state copied again or put in shared memory, and a fork of a process holding CUDA/NCCL state is unsafe).
One worker keeps saves in order; `finalize_fn`s run strictly in schedule order in the caller's thread,
so the tracker only moves forward and never before its checkpoint is durable. If `fn` raises, its
`finalize_fn` never runs and the error is re-raised from `maybe_finalize`.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Self


class AsyncSaver:
    """At most `max_pending` saves in flight; `schedule` first finalizes older ones to make room."""

    def __init__(self, max_pending: int = 1):
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kubetron-async-save")
        self._pending: collections.deque[tuple[Future, Callable[[], Any] | None]] = collections.deque()
        self._closed = False

    @property
    def pending(self) -> int:
        """Saves scheduled and not yet finalized (running, finished, or failed and not yet reported)."""
        return len(self._pending)

    def ready(self) -> bool:
        """True when the oldest pending save's background part has finished (finalizing won't block)."""
        return bool(self._pending) and self._pending[0][0].done()

    def schedule(self, fn: Callable[[], Any], finalize_fn: Callable[[], Any] | None = None) -> None:
        """Run `fn()` in the background worker; `finalize_fn()` later, in `maybe_finalize`.

        Blocks (finalizing older saves, which may raise their errors) while `max_pending` are in flight.
        """
        if self._closed:
            raise RuntimeError("AsyncSaver is closed")
        while len(self._pending) >= self.max_pending:
            self._finalize_one()
        self._pending.append((self._pool.submit(fn), finalize_fn))

    def maybe_finalize(self, blocking: bool = False) -> int:
        """Finalize finished saves in schedule order; returns how many. `blocking`: wait for all.

        Raises the first error of a failed `fn` (that save is dropped; later ones stay queued).
        """
        n = 0
        while self._pending and (blocking or self._pending[0][0].done()):
            self._finalize_one()
            n += 1
        return n

    def _finalize_one(self) -> None:
        fut, finalize_fn = self._pending[0]
        try:
            fut.result()
        finally:
            self._pending.popleft()
        if finalize_fn is not None:
            finalize_fn()

    def close(self) -> None:
        """Wait for and finalize everything still pending, then stop the worker (errors are raised)."""
        if self._closed:
            return
        try:
            self.maybe_finalize(blocking=True)
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # don't mask the original error; still wait so no save is left half-way in the background
            with contextlib.suppress(Exception):
                self.close()
