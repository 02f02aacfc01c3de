"""Process start-up is part of in-place recovery time (docs/recovery.md): the run's setup (kubetron.compat)
defers megatron-core's import-time `torch.compile` of its fusion kernels to their first call and its import of
wandb to wandb's first use; the trainer measures its start-up by phase (kubetron.startup)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from kubetron.compat.torch import compile_on_first_call
from kubetron.supervisor import startup

pytestmark = pytest.mark.process


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


def test_importing_the_trainer_changes_no_library():
    code = ("import sys, types, torch, kubetron.training.entry, kubetron.training.model, kubetron.training.pipeline\n"
            "from megatron.core.tensor_parallel import mappings, random\n"
            "from megatron.core.transformer.moe import moe_utils, token_dispatcher\n"
            "print(torch.compile.__module__, type(sys.modules['wandb']) is types.ModuleType,"
            " hasattr(moe_utils, 'te_general_gemm'), token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream,"
            " mappings._gather_along_first_dim.__module__, random._get_cuda_rng_state.__module__)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["torch", "True", "False", "None", "megatron.core.tensor_parallel.mappings",
                                  "megatron.core.tensor_parallel.random"], out


def test_the_runs_setup_imports_megatron_core_without_dynamo_or_wandb():
    code = ("import sys, torch, kubetron.training\n"
            "from kubetron.compat import megatron_core\n"
            "megatron_core.install()\n"
            "import megatron.core.jit as jit\n"
            "print('torch._dynamo' in sys.modules, jit.jit_fuser is torch.compile, torch.compile.__module__,"
            " 'wandb.sdk' in sys.modules)\n"
            "import wandb, megatron.core.timers as timers\n"  # megatron's own `wandb` is the same module, usable
            "print(callable(wandb.init), timers.wandb is wandb, 'wandb.sdk' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True)
    dynamo_loaded, fuser_is_compile, compile_restored, wandb_ran = out.stdout.split("\n")[0].split()
    assert (dynamo_loaded, fuser_is_compile, compile_restored) == ("False", "False", "torch"), out  # restored
    assert wandb_ran == "False", out
    assert out.stdout.split("\n")[1].split() == ["True", "True", "True"], out  # ran on first use


def test_the_startup_clock_times_each_phase_from_the_process_start(monkeypatch):
    before = time.time()
    code = ("import time; t = time.time(); from kubetron.supervisor import startup; "
            "print(startup.process_start_time(), t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    started, first_statement = map(float, out.split())
    assert before - 0.01 <= started <= first_statement  # the fork (10 ms ticks), before the interpreter started
    started = startup.process_start_time()
    now = [started + 1.0]
    monkeypatch.setattr(startup.time, "time", lambda: now[0])
    clock = startup.StartupClock(started)
    for phase, seconds in zip(startup.PHASES[:-1], (0.25, 2.5, 0.5, 0.75, 0.125), strict=True):
        now[0] += seconds
        clock.mark(phase)
    now[0] += 0.5
    line = clock.finish(11)
    assert line == ("start-up: 5.62 s from process start to the end of iteration 11: python + config 1.25 s, "
                    "imports 2.50 s, distributed init 0.50 s, model + data 0.75 s, checkpoint load 0.12 s, "
                    "first step 0.50 s")
    assert clock.finish(12) is None  # once per process
    total, iteration, phases = startup.parse_line(f"[kubetron 16:40:36] {line}\n")
    assert (total, iteration, list(phases)) == (5.62, 11, list(startup.PHASES))
    assert phases["python + config"] == 1.25 and phases["first step"] == 0.5
    with pytest.raises(ValueError, match="unknown start-up phase"):
        clock.mark("imprts")
    assert time.time() > started
