"""The trainer core end to end, through the real `kubetron` command: train, stop, resume, finish."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from kubetron.contract import exitcodes

from tests.trainer_utils import (
    ITER_RE,
    TINY,
    HeldReader,
    iteration_at_least,
    run,
    run_until_iteration,
    run_until_iteration_then_signal,
    tb_scalars,
)

ITERS = 40
# Evaluation every 10 iterations, long enough (eval_iters) that a signal can land inside it.
COMMON = [f"train.train_iters={ITERS}", "checkpoint.save_interval=10", "logger.log_interval=1",
          "validation.eval_interval=10", "validation.eval_iters=150"]


def train_args(d, *extra):
    return ["train", "--config", TINY, *COMMON, f"checkpoint.save={d}", f"checkpoint.load={d}",
            f"logger.tensorboard_dir={d}/tb", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("reference")
    p = run(train_args(d), d)
    assert p.returncode == 0, p.stderr[-3000:]
    return {"dir": d, "loss": tb_scalars(d / "tb"), "valid": tb_scalars(d / "tb", "lm loss validation"),
            "stdout": p.stdout}


def test_done_when_2_layout_and_tensorboard(tmp_path):
    """The exact command of the issue leaves iter_0000040, the tracker, progress.txt and lm loss 1..40."""
    d = tmp_path / "D"
    p = run(["train", "--config", TINY, "train.train_iters=40", f"checkpoint.save={d}",
             "checkpoint.save_interval=10", f"logger.tensorboard_dir={d}/tb"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (d / "iter_0000040" / "metadata.json").is_file()
    assert (d / "iter_0000040" / "run_config.yaml").is_file()
    assert (d / "latest_train_state.pt").is_file()
    progress = (d / "progress.txt").read_text()
    assert "Starting job" in progress and "Saved checkpoint\tIteration: 40" in progress
    loss = tb_scalars(d / "tb")
    assert sorted(loss) == list(range(1, 41))
    assert loss[40] < loss[1] - 0.5, f"loss did not fall: {loss[1]} -> {loss[40]}"
    assert p.termination["reason"] == "Completed" and p.termination["lastCheckpoint"] == 40
    # `kubetron progress` reads the same log the operator reads
    q = run(["progress", str(d), "--json"], tmp_path)
    summary = json.loads(q.stdout)
    assert summary["lastCheckpoint"]["iteration"] == 40 and summary["completed"] is True


@pytest.mark.parametrize("k", [7, 23])
def test_sigterm_then_resume_is_bit_exact(reference, tmp_path, k):
    d = tmp_path / "run"
    code, out, err, term = run_until_iteration_then_signal(train_args(d), tmp_path, k)
    assert code == exitcodes.SAVED_ON_SIGNAL, err[-3000:]
    saved = term["lastCheckpoint"]
    assert saved >= k and (d / f"iter_{saved:07d}" / "metadata.json").is_file()
    assert term["reason"] == "SavedOnSignal" and term["iteration"] == saved
    assert "Exiting job" in (d / "progress.txt").read_text()

    p = run(train_args(d), tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and f"iteration {saved}" in p.stdout
    loss = tb_scalars(d / "tb")
    resumed = {i: loss[i] for i in range(saved + 1, ITERS + 1)}
    assert resumed == {i: reference["loss"][i] for i in range(saved + 1, ITERS + 1)}
    valid = tb_scalars(d / "tb", "lm loss validation")
    assert {i: valid[i] for i in valid if i > saved} == {i: v for i, v in reference["valid"].items() if i > saved}


def test_sigterm_during_evaluation(reference, tmp_path):
    """A signal that arrives while evaluating at iteration 20 saves iter_20 after the evaluation."""
    d = tmp_path / "run"
    code, out, err, term = run_until_iteration_then_signal(train_args(d), tmp_path, 20, delay=0.2)
    assert code == exitcodes.SAVED_ON_SIGNAL, err[-3000:]
    assert term["lastCheckpoint"] == 20, out[-2000:]
    assert "validation loss at iteration 20" in out
    p = run(train_args(d), tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    loss = tb_scalars(d / "tb")
    assert all(loss[i] == reference["loss"][i] for i in range(21, ITERS + 1))
    valid = tb_scalars(d / "tb", "lm loss validation")
    assert valid[30] == reference["valid"][30] and valid[40] == reference["valid"][40]


def test_sigint_is_handled_like_sigterm(tmp_path):
    d = tmp_path / "run"
    code, out, err, term = run_until_iteration_then_signal(train_args(d), tmp_path, 3, sig=signal.SIGINT)
    assert code == exitcodes.SAVED_ON_SIGNAL, err[-3000:]
    assert term["lastCheckpoint"] >= 3


def test_a_late_signaller_still_signals_inside_the_run():
    """The tests above signal a run at iteration k from a reader that a loaded machine may not schedule for a
    while; the run must not get past the end meanwhile (once in CI a run signalled at 3 of 8 had finished).
    The reader holds it: a writer of 2000 iteration lines, signalled two seconds late, printed about a dozen
    more lines, not the rest."""
    line = "print(f'iteration {i:8d}/ 2000 | ' + 'x' * 300, flush=True)"
    p = subprocess.Popen([sys.executable, "-c", f"for i in range(1, 2001): {line}"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)

    def late_signal():
        time.sleep(2)
        p.send_signal(signal.SIGTERM)

    out = run_until_iteration(p, 3, late_signal, 60)
    last = max(int(m) for m in ITER_RE.findall(out))
    assert p.returncode == -signal.SIGTERM and 3 < last < 20, (p.returncode, last)


def test_a_held_reader_holds_the_writer_until_released(tmp_path):
    """The multi-process tests act (kill, SIGSTOP) on ranks at iteration k from a test thread that may run late.
    `HeldReader` stops at the line: a writer of 2000 iteration lines, looked at two seconds later, has printed
    about a dozen lines more and no further; once released it runs to the end and every line reaches the sink,
    in order. A writer that ends before the line fails the wait with its output."""
    line = "print(f'iteration {i:8d}/ 2000 | ' + 'x' * 300, flush=True); print(i, file=sys.stderr, flush=True)"
    with open(tmp_path / "written", "w") as written:  # how far the writer got: the number of its last line
        p = subprocess.Popen([sys.executable, "-c", f"import sys\nfor i in range(1, 2001): {line}"],
                             stdout=subprocess.PIPE, stderr=written, text=True, start_new_session=True)
    lines: list[str] = []
    reader = HeldReader(p, lines.append, iteration_at_least(3))
    with reader.held(60) as line:  # released after the block
        assert ITER_RE.search(line).group(1) == "3"
        time.sleep(2)
        last = int((tmp_path / "written").read_text().split()[-1])
        assert p.poll() is None and len(lines) == 3 and 3 <= last < 20, (len(lines), last)
    assert p.wait(timeout=60) == 0
    reader.join(timeout=10)
    assert [int(m.group(1)) for m in map(ITER_RE.search, lines)] == list(range(1, 2001))

    short = subprocess.Popen([sys.executable, "-c", "print('iteration 1/ 2', flush=True)"], stdout=subprocess.PIPE,
                             text=True)
    with pytest.raises(AssertionError, match="before the line to hold at"):
        HeldReader(short, lambda line: None, iteration_at_least(3)).wait_held(60, explain=lambda: "iteration 1")
