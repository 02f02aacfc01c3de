"""A run's life as typed events (kubetron.events): what a run tells its listeners, in which order, and what a
listener that fails or a peer that dies does to it. In this process (tests/inprocess.py)."""

from __future__ import annotations

import logging

import pytest
from kubetron.contract import exitcodes
from kubetron.contract.hang import CHECKPOINT, TRAIN
from kubetron.events import (
    CheckpointDurable,
    Ended,
    Evaluated,
    Events,
    Logged,
    PhaseEntered,
    PhaseLeft,
    SnapshotWritten,
    Started,
    StepDone,
    Stopping,
)

from tests.inprocess import PEER_FAILURE, Driver, drive
from tests.trainer_utils import QUICK

pytestmark = pytest.mark.trainer


def test_a_listener_that_raises_is_reported_once_and_dropped_and_the_others_still_hear(caplog):
    heard: list[str] = []

    def broken(event):
        raise ValueError("listener bug")

    events = Events([broken, lambda event: heard.append(type(event).__name__)])
    with caplog.at_level(logging.WARNING, logger="kubetron"):
        events.emit(Stopping(0, "done"))
        events.emit(Ended(0, "done", 7))
    assert heard == ["Stopping", "Ended"]
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) == 1 and "broken" in reports[0] and "Stopping" in reports[0] and "listener bug" in reports[0]


def test_a_run_tells_its_life_in_order_and_a_failing_listener_changes_nothing(tmp_path, caplog, monkeypatch):
    """Started, then per step a StepDone with its figures (a Logged at each log interval), a checkpoint's save
    between CHECKPOINT phase events and its CheckpointDurable, then Stopping and Ended: to every listener, also
    when one of them raises (it is reported in one warning and dropped; the run completes as without it). The
    config is finalized once and the device and backend chosen once."""
    from kubetron.config import ConfigContainer
    from kubetron.contract.config import DistributedInitConfig

    calls = {"finalize": 0, "resolve_device": 0}
    for cls, name in ((ConfigContainer, "finalize"), (DistributedInitConfig, "resolve_device")):
        def counted(self, *args, _real=getattr(cls, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, counted)

    def fails_at_step_3(event):
        if isinstance(event, StepDone) and event.iteration == 3:
            raise RuntimeError("a dashboard that went away")

    driver = Driver()
    with caplog.at_level(logging.WARNING, logger="kubetron"):
        out = drive(tmp_path, *QUICK, "train.train_iters=6", "scheduler.lr_warmup_iters=1", "logger.log_interval=2",
                    "checkpoint.save_interval=4",
                    f"checkpoint.save={tmp_path / 'ckpt'}", driver=driver, listeners=[fails_at_step_3])
    assert out.code == exitcodes.COMPLETED and out.termination["reason"] == "Completed"
    warnings = [r.getMessage() for r in caplog.records if "fails_at_step_3" in r.getMessage()]
    assert len(warnings) == 1 and "StepDone" in warnings[0] and "a dashboard that went away" in warnings[0]

    kinds = [type(e).__name__ for e in driver.events]
    assert kinds.index("Started") < kinds.index("StepDone") and kinds[-1] == "Ended" and kinds.count("Ended") == 1
    stopping = kinds.index("Stopping")  # the loop's end: then the evaluations after training, then teardown
    assert stopping > max(i for i, k in enumerate(kinds) if k == "StepDone")
    assert [e.label for e in driver.events[stopping:] if isinstance(e, Evaluated)] == ["validation", "test"]
    steps = driver.of(StepDone)
    assert [s.iteration for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [s.consumed_samples for s in steps] == [8 * i for i in range(1, 7)]
    assert all(s.seconds > 0 and s.learning_rate > 0 and set(s.losses) == {"lm loss"} for s in steps)
    assert [e.iteration for e in driver.of(Logged)] == [2, 4, 6]
    assert [e.checkpoint.iteration for e in driver.of(CheckpointDurable)] == [4, 6]
    assert driver.of(CheckpointDurable)[0].train_state["consumed_train_samples"] == 32
    phases = [(type(e).__name__, e.phase) for e in driver.events if isinstance(e, PhaseEntered | PhaseLeft)]
    assert ("PhaseEntered", TRAIN) in phases and ("PhaseEntered", CHECKPOINT) in phases
    assert phases.count(("PhaseEntered", CHECKPOINT)) == phases.count(("PhaseLeft", CHECKPOINT))
    assert driver.of(Started)[0].iteration == 0 and driver.of(Started)[0].checkpoint is None
    assert driver.of(Stopping)[0].code == driver.of(Ended)[0].code == exitcodes.COMPLETED
    assert driver.of(Ended)[0].iteration == 6
    assert calls == {"finalize": 1, "resolve_device": 1}


def test_each_memory_snapshot_written_is_told_once_with_its_write_time(tmp_path):
    """Memory snapshots every 2 iterations: a SnapshotWritten for each, in order (from the writer thread), each
    one's write time, and the snapshot it names is the one in the rank's directory."""
    from kubetron.storage import snapshot_files as sf

    driver = Driver()
    out = drive(tmp_path, *QUICK, "train.train_iters=6", "scheduler.lr_warmup_iters=1", "logger.log_interval=2",
                "checkpoint.non_persistent_ckpt_type=local", "checkpoint.non_persistent_save_interval=2",
                f"checkpoint.non_persistent_local_ckpt_dir={tmp_path / 'memory'}",
                f"checkpoint.save={tmp_path / 'ckpt'}", driver=driver)
    assert out.code == exitcodes.COMPLETED
    written = driver.of(SnapshotWritten)
    assert [e.iteration for e in written] == [2, 4, 6] and all(e.seconds > 0 for e in written)
    assert sf.iterations(sf.own_dir(tmp_path / "memory", 0))[-1] == 6


def test_a_peer_that_fails_mid_run_ends_it_as_a_peer_failure(tmp_path):
    """A collective that raises what gloo raises when a peer died, in the step after iteration 5: exit 5
    (PeerFailure, which the pod's launcher restarts in place), the newest checkpoint in the termination message."""
    d = tmp_path / "ckpt"
    out = drive(tmp_path, *QUICK, "train.train_iters=20", "checkpoint.save_interval=4", f"checkpoint.save={d}",
                driver=Driver().peer_fails_after(5))
    assert out.code == exitcodes.PEER_FAILURE
    term = out.termination
    assert term["reason"] == "PeerFailure" and PEER_FAILURE in term["message"]
    assert term["iteration"] == 5 and term["lastCheckpoint"] == 4
    assert [type(e).__name__ for e in out.driver.events[-2:]] == ["Stopping", "Ended"]  # no evaluation after a failure
    assert "Exiting job\tIteration: 5" in (d / "progress.txt").read_text()


def test_a_peer_that_fails_while_a_save_is_pending_still_ends_it_as_a_peer_failure(tmp_path):
    """A peer dies while this rank's async save of iteration 4 is still to be finalized (the finalize, a
    collective in a gang, fails too): the ending stays the peer's failure, every listener hears it (the
    termination message with its iteration and the checkpoint before, the progress log's exit line), and the
    unfinished save is never committed."""
    d = tmp_path / "ckpt"

    class Driven(Driver):
        def faults(self, point: str, iteration: int) -> None:
            if (point, iteration) == ("after-payload", 8):
                raise OSError("Connection reset by peer (the finalize's collective)")

    out = drive(tmp_path, *QUICK, "train.train_iters=20", "checkpoint.save_interval=4", f"checkpoint.save={d}",
                "checkpoint.async_save=true", driver=Driven().peer_fails_after(8))
    assert out.code == exitcodes.PEER_FAILURE
    term = out.termination
    assert term["reason"] == "PeerFailure" and PEER_FAILURE in term["message"], term
    assert term["iteration"] == 8 and term["lastCheckpoint"] == 4, term
    names = [type(e).__name__ for e in out.driver.events]
    assert names[-1] == "Ended" and names.count("Ended") == 1 and "Stopping" in names, names[-4:]
    assert "Exiting job\tIteration: 8" in (d / "progress.txt").read_text()
    assert not (d / "iter_0000008").exists()
