"""torch: `torch.compile` deferred to first call while another library is imported (megatron-core
decorates its fusion kernels with it at import, which imports TorchDynamo and Inductor even when no fused
kernel ever runs); the elastic agent's adaptations that `kubetron.supervisor.torchrun` installs live in `elastic`.
Checked against torch 2.11 (the GPU machines) and 2.13 (CI).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kubetron.compat import require_checked

CHECKED = ">=2.11,<2.14"


def compile_on_first_call(compile_now: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for `torch.compile(fn, **options)` as a decorator that calls `compile_now` on first use."""

    def compile_later(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        if fn is None:  # @torch.compile(**options)
            return lambda f: compile_later(f, **options)
        compiled = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(fn, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_later


@contextlib.contextmanager
def compile_deferred() -> Iterator[None]:
    """While inside: `torch.compile` compiles a function on its first call, with the same options, so what
    runs is the same; the real one is back on the way out."""
    require_checked("torch", CHECKED)
    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        yield
    finally:
        torch.compile = real
