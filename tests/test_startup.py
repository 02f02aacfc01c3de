"""Process start-up is part of in-place recovery time (docs/recovery.md): importing the trainer defers
megatron-core's import-time `torch.compile` of its fusion kernels to their first call."""

from __future__ import annotations

import subprocess
import sys

from kubetron.training import compile_on_first_call


def test_compile_on_first_call_compiles_once_with_the_same_options():
    compiled: list[tuple[str, dict]] = []

    def compile_now(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    later = compile_on_first_call(compile_now)

    @later
    def add(a, b):
        return a + b

    @later(dynamic=True)
    def neg(a):
        return -a

    assert compiled == [] and add.__name__ == "add"  # nothing compiled at decoration
    assert add(1, 2) == ("compiled", 3) and add(2, 2) == ("compiled", 4)
    assert neg(1) == ("compiled", -1)
    assert compiled == [("add", {}), ("neg", {"dynamic": True})]  # once each, options kept


def test_importing_the_trainer_does_not_import_dynamo():
    code = ("import sys, torch, kubetron.training, megatron.core.jit as jit\n"
            "print('torch._dynamo' in sys.modules, jit.jit_fuser is torch.compile, torch.compile.__module__)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True)
    dynamo_loaded, fuser_is_compile, compile_restored = out.stdout.split()
    assert (dynamo_loaded, fuser_is_compile, compile_restored) == ("False", "False", "torch"), out  # restored
