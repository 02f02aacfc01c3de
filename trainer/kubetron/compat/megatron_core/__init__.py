"""megatron-core, checked against 0.16.1 (the pin in constraints.txt; the GPU machines run the same).

`install()` is the run's first step, before megatron-core is imported: it imports megatron-core with two
import-time costs deferred to first use (docs/recovery.md: start-up is most of an in-place restart's
recovery time):

- `torch.compile`: megatron decorates its fusion kernels with it at import time, which imports
  TorchDynamo and Inductor (about a third of `import megatron.core`) even when no fused kernel ever
  runs. Deferred (kubetron.compat.torch), a decorated function is compiled on its first call instead.
- `wandb` (~0.4 s): megatron's inference context imports it at import time and never uses it in
  training. It is bound lazily: the module runs on first attribute use (`wandb.init` when
  logger.wandb_project is set), so training without wandb never loads it.

The pieces of megatron-core that hard-code CUDA are made portable by `portable` (imported after install); the
private parts of its optimizer that checkpoints read are named in `optimizer`.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from typing import Any

from kubetron.compat import require_checked

CHECKED = "==0.16.1"


def install() -> None:
    """Import megatron-core the trainer's way (above), after checking its version and torch's; idempotent.
    Called after megatron-core was imported some other way (a script calling `pretrain()`), it checks the
    versions and defers nothing."""
    from kubetron.compat import torch as torch_compat

    require_checked("megatron-core", CHECKED)
    require_checked("torch", torch_compat.CHECKED)
    if "megatron.core" in sys.modules:
        return

    import_lazily("wandb")
    with torch_compat.compile_deferred(), warnings.catch_warnings():
        # "TE and Apex are not installed": the CLI's one-line errors stay one line
        warnings.filterwarnings("ignore", module="megatron")
        import megatron.core  # noqa: F401 - its fusion modules bind the stand-in


class _LazyModule(types.ModuleType):
    """A module whose code runs on the first access to an attribute it does not have yet. Unlike
    importlib's LazyLoader, the spec's dunders (`__file__`, `__path__`, ...) do not count: torch's
    custom-op registration scans every module's `__file__` at import time (inspect.getmodule)."""

    def __getattr__(self, attr: str) -> Any:
        self.__class__ = types.ModuleType  # type: ignore[assignment]  # a module stops being lazy once run
        spec = self.__spec__
        assert spec is not None and spec.loader is not None  # import_lazily binds only modules with a loader
        spec.loader.exec_module(self)
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
