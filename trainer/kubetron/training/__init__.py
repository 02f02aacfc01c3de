"""The training half: model, loop, checkpoints (imports torch and megatron-core).

Importing the package imports megatron-core with two import-time costs deferred to first use
(docs/recovery.md: start-up is most of an in-place restart's recovery time):

- `torch.compile`: megatron decorates its fusion kernels with it at import time, which imports
  TorchDynamo and Inductor (about a third of `import megatron.core`) even when no fused kernel ever
  runs. Deferred, a decorated function is compiled on its first call instead, with the same options,
  so what runs is the same.
- `wandb` (~0.4 s): megatron's inference context imports it at import time and never uses it in
  training. It is bound lazily: the module runs on first attribute use (`wandb.init` when
  logger.wandb_project is set), so training without wandb never loads it.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
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


class _LazyModule(types.ModuleType):
    """A module whose code runs on the first access to an attribute it does not have yet. Unlike
    importlib's LazyLoader, the spec's dunders (`__file__`, `__path__`, ...) do not count: torch's
    custom-op registration scans every module's `__file__` at import time (inspect.getmodule)."""

    def __getattr__(self, attr: str) -> Any:
        self.__class__ = types.ModuleType
        self.__spec__.loader.exec_module(self)
        return getattr(self, attr)


def import_lazily(name: str) -> None:
    """Bind module `name` in sys.modules without running it yet. No-op when it is imported already or
    not installed."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _LazyModule
    sys.modules[name] = module


def _import_megatron_core() -> None:
    if "megatron.core" in sys.modules:
        return
    import torch

    import_lazily("wandb")
    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        with warnings.catch_warnings():  # "TE and Apex are not installed": the CLI's one-line errors stay one line
            warnings.filterwarnings("ignore", module="megatron")
            import megatron.core  # noqa: F401 - its fusion modules bind the stand-in
    finally:
        torch.compile = real


_import_megatron_core()
