"""The training half: model, loop, checkpoints (imports torch and megatron-core).

Importing the package imports megatron-core with `torch.compile` deferred: megatron decorates its
fusion kernels with `torch.compile` at import time, which imports TorchDynamo and Inductor (about a
third of `import megatron.core`, docs/recovery.md) even when no fused kernel ever runs. Deferred, a
decorated function is compiled on its first call instead, with the same options, so what runs is the same.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any


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


def _import_megatron_core() -> None:
    if "megatron.core" in sys.modules:
        return
    import torch

    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        with warnings.catch_warnings():  # "TE and Apex are not installed": the CLI's one-line errors stay one line
            warnings.filterwarnings("ignore", module="megatron")
            import megatron.core  # noqa: F401 - its fusion modules bind the stand-in
    finally:
        torch.compile = real


_import_megatron_core()
