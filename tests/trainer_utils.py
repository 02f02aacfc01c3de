"""The process tier's harness: tests that run the real `kubetron` command (or a pod's launcher) in a process.

One environment builder (`env_for`; `pod_env` and tests/multirank build on it), one reader that collects a
process's lines (`LineReader`; a test acts at the run's own step: `stopped_trainer`, `sigterm_while_stopped`,
tests.multirank.runner.fault_at), one pattern for Megatron's console line (`ITER_RE`, and `LOSS_RE`/`CONSUMED_RE`
that read its figures). Tests that act on a run at a step run it in their own process instead (tests/inprocess.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.ports import free_port  # noqa: F401 - the harness's one port picker, re-exported

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "examples" / "tiny-gpt.yaml")
ITER_RE = re.compile(r"iteration\s+(\d+)/")
"""Megatron's console line of iteration N (` iteration       N/   TOTAL | ...`)."""
LOSS_RE = re.compile(ITER_RE.pattern + r".*?lm loss: ([0-9.E+-]+)")  # ... and its lm loss
CONSUMED_RE = re.compile(ITER_RE.pattern + r"\s*\d+ \| consumed samples:\s+(\d+)")  # ... and its consumed samples
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "KUBETRON_LAUNCH_MESSAGES")
"""What a process started by a test must not inherit: a rank's place in a world (torchrun's, the launcher's)."""
QUICK = ["train.train_iters=400", "logger.log_interval=1", "validation.eval_interval=null",
         "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.seq_length=32"]
"""An even smaller GPT than TINY's, for tests about how a run ends rather than what it learns."""


def env_for(tmp: Path, **extra) -> dict:
    """The environment of a process a test starts: this one's, less a rank's variables (RANK_VARS), with
    unbuffered output, its own termination log under `tmp`, then `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env["KUBETRON_TERMINATION_LOG"] = str(tmp / f"termination-{time.monotonic_ns()}.log")
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def pod_env(tmp_path: Path, nproc: int, **extra: str) -> dict:
    """What the operator puts in a one-node pod's environment (docs/CONTRACT.md)."""
    return env_for(tmp_path, NNODES="1", NODE_RANK="0", NPROC_PER_NODE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), KUBETRON_TERMINATION_LOG=str(tmp_path / "termination-log"),
                   OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), **extra)


def is_trainer(process) -> bool:
    """`process` (psutil) is a rank's trainer: `python -m kubetron train ...` under torchrun, or the module
    KUBETRON_LAUNCH_MODULE names in its environment (bench/padded_trainer.py), not a pod's launcher or agent."""
    import psutil

    with contextlib.suppress(psutil.Error):
        cmd = process.cmdline()
        if cmd[1:2] == ["-m"] and cmd[3:4] == ["train"]:
            return cmd[2] == "kubetron" or cmd[2] == process.environ().get("KUBETRON_LAUNCH_MODULE")
    return False


def trainer_of(pid: int, what: str = "the container"):
    """The trainer process (psutil, `is_trainer`) among `pid`'s descendants: a pod's, not its PID 1."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        if is_trainer(child):
            return child
    raise AssertionError(f"no trainer process in {what}")


def pending(pid: int, sig: int) -> bool:
    """Whether `sig` is pending for process `pid` (/proc/<pid>/status: ShdPnd, the process's; SigPnd, the thread's)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return any(int(fields[k].strip(), 16) >> (sig - 1) & 1 for k in ("ShdPnd", "SigPnd"))


def stopped_trainer(pod: subprocess.Popen, timeout: float, explain: Callable[[], str] = lambda: ""):
    """The pod's trainer once it has stopped itself (a SIGSTOP at its own step: tests.multirank.runner.fault_at)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(AssertionError, psutil.Error):
            trainer = trainer_of(pod.pid)
            if trainer.status() == psutil.STATUS_STOPPED:
                return trainer
        if pod.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the trainer did not stop itself (pod exit {pod.poll()}):\n{explain()}")
        time.sleep(0.02)


def sigterm_while_stopped(pod: subprocess.Popen, trainer, timeout: float) -> None:
    """The kubelet's SIGTERM to the pod's PID 1 while its trainer is stopped at its own step: the launcher and
    torchrun forward it; once it is pending in the trainer, the trainer goes on and meets it there."""
    pod.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not pending(trainer.pid, signal.SIGTERM):
        assert time.monotonic() < deadline, "the SIGTERM never reached the stopped trainer"
        time.sleep(0.02)
    trainer.resume()


def kubetron_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kubetron", *args]


def run(args: list[str], tmp: Path, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    e = env_for(tmp, **env)
    p = subprocess.run(kubetron_cmd(*args), env=e, capture_output=True, text=True, timeout=timeout)
    p.termination = read_termination(e["KUBETRON_TERMINATION_LOG"])
    return p


def read_termination(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class LineReader:
    """`proc`'s stdout, line by line, passed to `sink` from a thread of its own, as it comes. Tests act on a
    process at its own step (tests.multirank.runner.fault_at, faults_by_life), never at a line read from it."""

    def __init__(self, proc: subprocess.Popen, sink: Callable[[str], object]):
        self.proc, self._sink = proc, sink
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._sink(line)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def tb_scalars(logdir: Path, tag: str = "lm loss") -> dict[int, float]:
    """{step: value} of a TensorBoard scalar over all event files (the newest file wins a step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    files = sorted(Path(logdir).rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                values[ev.step] = ev.value
    return values


def bench_module(name: str):
    """bench/<name>.py as a module (bench/ is not a package), loaded once."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # a dataclass in it looks its module up there
        spec.loader.exec_module(module)
    return sys.modules[name]
