"""How a pod's trainer ends, as the pod's log and the kubelet see it: `python -m kubetron.launch` (the
image's entry point, running torchrun) with the environment the operator sets.

- The log ends with the trainer's own one line (`kubetron: error: ...`, `kubetron: Diverged: ...`,
  `kubetron: SavedOnSignal: ...`), not torchrun's ChildFailedError traceback and banner; the exit code
  is the contract's.
- A SIGTERM after the run completed (its termination message and "Exiting job ... Completed" written)
  still ends in exit 0, for the trainer process and for the pod's PID 1 (the launcher).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubetron.contract import exitcodes
from kubetron.supervisor import launch

from tests.multirank.runner import fault_at
from tests.trainer_utils import QUICK, TINY, LineReader, pod_env, sigterm_while_stopped, stopped_trainer

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.process, pytest.mark.slow]


def start_pod(tmp_path: Path, args: list[str], nproc: int = 1, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kubetron.launch", *args], env=pod_env(tmp_path, nproc, **extra),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(pod: subprocess.Popen, timeout: float = 300) -> tuple[int, list[str]]:
    try:
        out, _ = pod.communicate(timeout=timeout)
    finally:
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
            pod.wait()
    return pod.returncode, out.rstrip("\n").splitlines()


def termination(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "termination-log").read_text())


@pytest.mark.parametrize("nproc", [1, 2])
def test_config_error_pod_log_ends_with_the_one_line(tmp_path, nproc):
    rc, lines = finish(start_pod(tmp_path, ["train", "--config", TINY, "train.bogus=1"], nproc))
    assert rc == exitcodes.CONFIG_ERROR, lines
    assert lines[-1] == "kubetron: error: train.bogus: unknown key (see `kubetron config --reference`)", lines
    assert not any("Traceback" in line or "ChildFailedError" in line for line in lines), lines
    assert termination(tmp_path)["exitCode"] == exitcodes.CONFIG_ERROR


def test_diverged_pod_log_ends_with_the_one_line(tmp_path):
    spike = ["checkpoint.save=null", "optimizer.lr=5", "scheduler.lr_warmup_iters=0",
             "rerun_state_machine.check_for_spiky_loss=true", "rerun_state_machine.spiky_loss_window=1",
             "rerun_state_machine.spiky_loss_factor=1.2"]
    rc, lines = finish(start_pod(tmp_path, ["train", "--config", TINY, *QUICK, *spike]))
    assert rc == exitcodes.DIVERGED, lines[-30:]
    assert lines[-1].startswith("kubetron: Diverged: spiky loss at iteration "), lines[-30:]
    assert termination(tmp_path)["reason"] == "Diverged"


def test_preempted_pod_log_ends_with_the_one_line(tmp_path):
    """The kubelet SIGTERMs PID 1 mid-run: the rank saves, the pod exits 75, its log ends with the line."""
    pod = start_pod(tmp_path, ["train", "--config", TINY, *QUICK, f"checkpoint.save={tmp_path / 'ckpt'}"],
                    **fault_at(3, "STOP"))  # the trainer stops itself at its iteration 3: the SIGTERM meets it there
    out: list[str] = []
    reader = LineReader(pod, out.append)
    sigterm_while_stopped(pod, stopped_trainer(pod, 300, lambda: "".join(out)[-3000:]), 300)
    rc = pod.wait(timeout=300)
    reader.join(timeout=10)
    lines = "".join(out).rstrip("\n").splitlines()
    assert rc == exitcodes.SAVED_ON_SIGNAL, lines[-30:]
    assert lines[-1] == "kubetron: SavedOnSignal: stopped by signal; checkpoint saved", lines[-30:]
    assert termination(tmp_path)["reason"] == "SavedOnSignal"
    assert "saved checkpoint iter_0000003 at iteration 3" in "\n".join(lines), lines[-30:]  # where it stopped


def test_a_rank_killed_by_a_signal_is_named_in_the_last_line(tmp_path):
    """No rank explains (SIGKILLed, say by the OOM killer): the launcher's own line says which rank died how."""
    (tmp_path / "killed_trainer.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           launch.TRAINER_MODULE_ENV: "killed_trainer"}
    rc, lines = finish(start_pod(tmp_path, ["train"], **env))
    assert rc == exitcodes.ERROR, lines  # torchrun's status, as before: no rank said otherwise
    assert lines[-1].startswith("kubetron.launch: rank 0 (local rank 0, pid "), lines
    assert lines[-1].endswith(") was killed by SIGKILL and no rank wrote a termination message for it; see the "
                              "pod's log"), lines
    assert not any("Traceback" in line for line in lines), lines
    assert termination(tmp_path)["message"] == lines[-1].removeprefix("kubetron.launch: ")


# -- SIGTERM after the run completed --------------------------------------------------------------------

def _paused_at_exit(tmp_path: Path, command: list[str], env: dict) -> subprocess.Popen:
    env = {**env, "KUBETRON_TEST_PAUSED": str(tmp_path / "paused"), "KUBETRON_TEST_RESUME": str(tmp_path / "resume")}
    proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not (tmp_path / "paused").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"never reached the end of the process:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    return proc


def _sigterm_then_resume(tmp_path: Path, proc: subprocess.Popen) -> tuple[int, list[str]]:
    progress = (tmp_path / "ckpt" / "progress.txt").read_text().splitlines()
    assert "Exiting job" in progress[-1] and "Completed" in progress[-1], progress  # the window of the bug
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # the signal is delivered (and, for the pod, forwarded to the rank) before we go on
    (tmp_path / "resume").touch()
    return finish(proc, timeout=120)


def _completed_run(tmp_path: Path) -> list[str]:
    return ["train", "--config", TINY, *QUICK, "train.train_iters=3", "scheduler.lr_warmup_iters=1",
            f"checkpoint.save={tmp_path / 'ckpt'}"]


def test_sigterm_after_completion_exits_0(tmp_path):
    """The trainer process paused after its last line of teardown work: SIGTERM must not make it 143."""
    env = {**os.environ, "KUBETRON_TERMINATION_LOG": str(tmp_path / "termination-log"), "PYTHONUNBUFFERED": "1"}
    proc = _paused_at_exit(tmp_path, [sys.executable, "-m", "tests.teardown_pause", *_completed_run(tmp_path)], env)
    rc, lines = _sigterm_then_resume(tmp_path, proc)
    assert rc == exitcodes.COMPLETED, lines[-20:]
    assert termination(tmp_path)["reason"] == "Completed"


def test_sigterm_to_the_pod_after_completion_exits_0(tmp_path):
    """The same under the launcher: PID 1 gets the SIGTERM, torchrun forwards it to the finished rank and
    reports the signal; the pod exits 0 (its ranks completed), not 1 or 143, so nothing is rescheduled."""
    env = pod_env(tmp_path, 1, **{launch.TRAINER_MODULE_ENV: "tests.teardown_pause"})
    proc = _paused_at_exit(tmp_path, [sys.executable, "-m", "kubetron.launch", *_completed_run(tmp_path)], env)
    rc, lines = _sigterm_then_resume(tmp_path, proc)
    assert rc == exitcodes.COMPLETED, lines[-20:]
    assert termination(tmp_path)["reason"] == "Completed"
    assert not any("Traceback" in line for line in lines), lines


# -- SIGTERM during the last iteration ---------------------------------------------------------------------

class _SigtermAt:
    """The default GPT forward step; at one iteration it SIGTERMs its own process (as the kubelet would)."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    def __call__(self, state, data_iterator, model):
        from kubetron.training.gpt_step import forward_step

        if state.train_state.step + 1 == self.iteration:
            os.kill(os.getpid(), signal.SIGTERM)
        return forward_step(state, data_iterator, model)


@pytest.mark.parametrize("at, expected", [(4, exitcodes.SAVED_ON_SIGNAL), (5, exitcodes.COMPLETED)])
def test_sigterm_in_the_last_iteration_completes_the_run(tmp_path, at, expected):
    """A signal mid-run saves and exits 75 (restart, free); one during the last iteration completes the run
    (0, its final checkpoint saved): a 75 there would reschedule a gang only to find the job done."""
    from tests.inprocess import in_process_config, run_pretrain

    cfg = in_process_config("train.train_iters=5", "scheduler.lr_warmup_iters=1", "train.exit_signal_handler=true",
                            f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=100")
    assert run_pretrain(cfg, _SigtermAt(at)) == expected
    progress = (tmp_path / "ckpt" / "progress.txt").read_text()
    assert f"Saved checkpoint\tIteration: {at}" in progress and exitcodes.NAMES[expected] in progress.splitlines()[-1]


def test_a_settled_signal_handler_ignores_later_signals():
    """After the loop (settle), a SIGTERM neither kills the process nor is recorded: it cannot turn the
    decided ending (say a trainer error, 1) into 'stopped by signal during setup' (75)."""
    from kubetron.training.state import SignalHandler

    before = signal.getsignal(signal.SIGTERM)
    handler = SignalHandler((signal.SIGTERM,))
    try:
        handler.settle()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the Python-level handler runs at the next bytecode boundary
        assert handler.received is None
    finally:
        handler.release()
    assert signal.getsignal(signal.SIGTERM) == before
