"""The trainer core end to end, through `kubetron train`'s own path in this process (tests/inprocess.py): train,
stop at an exact step, resume bit-exactly, finish."""

from __future__ import annotations

import json
import os
import signal

import pytest
from kubetron.contract import exitcodes
from kubetron.contract.hang import EVALUATION
from kubetron.events import Evaluated, Started

from tests.inprocess import Driver, drive
from tests.trainer_utils import tb_scalars

pytestmark = pytest.mark.trainer

ITERS = 40
COMMON = [f"train.train_iters={ITERS}", "checkpoint.save_interval=10", "logger.log_interval=1",
          "validation.eval_interval=10"]


def train_overrides(d, *extra):
    return [*COMMON, f"checkpoint.save={d}", f"checkpoint.load={d}", f"logger.tensorboard_dir={d}/tb", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("reference")
    out = drive(d, *train_overrides(d))
    assert out.code == exitcodes.COMPLETED
    return {"dir": d, "loss": tb_scalars(d / "tb"), "valid": tb_scalars(d / "tb", "lm loss validation"),
            "termination": out.termination}


def test_a_completed_run_leaves_megatron_s_layout_tensorboard_and_the_progress_log(reference, capsys):
    """iter_0000040 with its marker and run_config.yaml, the tracker, progress.txt, lm loss 1..40 falling, the
    termination message, and `kubetron progress` reading the log the operator reads."""
    from kubetron import cli

    d = reference["dir"]
    assert (d / "iter_0000040" / "metadata.json").is_file()
    assert (d / "iter_0000040" / "run_config.yaml").is_file()
    assert (d / "latest_train_state.pt").is_file()
    progress = (d / "progress.txt").read_text()
    assert "Starting job" in progress and "Saved checkpoint\tIteration: 40" in progress
    loss = reference["loss"]
    assert sorted(loss) == list(range(1, 41))
    assert loss[40] < loss[1] - 0.5, f"loss did not fall: {loss[1]} -> {loss[40]}"
    term = reference["termination"]
    assert term["reason"] == "Completed" and term["lastCheckpoint"] == 40 and term["iteration"] == 40
    capsys.readouterr()
    assert cli.main(["progress", str(d), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["lastCheckpoint"]["iteration"] == 40 and summary["completed"] is True


def _resumed_matches(reference, d, saved: int):
    out = drive(d, *train_overrides(d))
    assert out.code == exitcodes.COMPLETED
    assert out.driver.of(Started)[0].iteration == saved  # resumed from the checkpoint the signal saved
    loss = tb_scalars(d / "tb")
    assert {i: loss[i] for i in range(saved + 1, ITERS + 1)} == {i: reference["loss"][i]
                                                                 for i in range(saved + 1, ITERS + 1)}
    valid = tb_scalars(d / "tb", "lm loss validation")
    assert {i: valid[i] for i in valid if i > saved} == {i: v for i, v in reference["valid"].items() if i > saved}


@pytest.mark.parametrize("k", [7, 23])
def test_sigterm_saves_that_step_and_the_resume_is_bit_exact(reference, tmp_path, k):
    """SIGTERM after iteration k: the step ends, iter_k is saved, the run exits 75 (SavedOnSignal) with the
    progress log's Exiting line; the resume trains k+1..40 with exactly the losses of the uninterrupted run."""
    d = tmp_path / "run"
    out = drive(d, *train_overrides(d), driver=Driver().signal_at(k))
    assert out.code == exitcodes.SAVED_ON_SIGNAL
    assert out.termination["reason"] == "SavedOnSignal" and out.termination["iteration"] == k
    assert out.termination["lastCheckpoint"] == k and (d / f"iter_{k:07d}" / "metadata.json").is_file()
    assert f"Exiting job\tIteration: {k}" in (d / "progress.txt").read_text()
    _resumed_matches(reference, d, k)


def test_sigterm_during_an_evaluation_saves_after_it(reference, tmp_path):
    """A signal that arrives while evaluating at iteration 20 lets the evaluation finish, then saves iter_20."""
    d = tmp_path / "run"
    driver = Driver()
    driver.at(19, lambda: driver.signal_in_phase(EVALUATION))  # the next evaluation: iteration 20's
    out = drive(d, *train_overrides(d), driver=driver)
    assert out.code == exitcodes.SAVED_ON_SIGNAL
    assert out.termination["lastCheckpoint"] == 20
    assert [e.iteration for e in out.driver.of(Evaluated)] == [10, 20]  # iteration 20's evaluation completed
    _resumed_matches(reference, d, 20)


def test_sigint_and_sigterm_reach_the_run_through_its_handler():
    """The handler `kubetron train` installs takes train.exit_signal and SIGINT from the OS (a real signal to
    this process) into `receive`, the one entry a signal takes into the run; the first one counts."""
    from kubetron.training.entry import exit_signals
    from kubetron.training.state import SignalHandler

    from tests.inprocess import in_process_config

    cfg = in_process_config()
    assert exit_signals(cfg) == (signal.SIGTERM, signal.SIGINT)
    for sig in exit_signals(cfg):
        handler = SignalHandler(exit_signals(cfg))
        try:
            os.kill(os.getpid(), sig)
            assert handler.received == sig and handler.signal_name == signal.Signals(sig).name
            handler.receive(signal.SIGTERM if sig == signal.SIGINT else signal.SIGINT)
            assert handler.received == sig
        finally:
            handler.release()
