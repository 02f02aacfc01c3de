"""Checkpoints end to end, on a path and on a real S3 server, through `kubetron train`'s own path in this process
(tests/inprocess.py), one run in a real process.

A save stopped at several of its points (the checkpoint manager's fault hook; one real SIGKILL through
KUBETRON_CHAOS_KILL_AT), a fault-injecting proxy in front of S3, async saves, non-persistent checkpoints, resume
from s3:// — each time the run that follows must resume from the newest *complete* checkpoint and reproduce an
uninterrupted run's losses exactly.
"""

from __future__ import annotations

import json
import pickle
import signal
import uuid

import pytest
from kubetron.contract import exitcodes
from kubetron.events import Started
from kubetron.supervisor.progress_io import summarize

from tests.faultproxy import FaultProxy
from tests.inprocess import Driver, SaveStopped, drive
from tests.trainer_utils import TINY, run, tb_scalars

pytestmark = pytest.mark.trainer

ITERS = 30
COMMON = [f"train.train_iters={ITERS}", "checkpoint.save_interval=10", "logger.log_interval=1",
          "validation.eval_interval=null", "checkpoint.most_recent_k=-1"]


def overrides(store: str, tb, *extra):
    return [*COMMON, f"checkpoint.save={store}", f"checkpoint.load={store}", f"logger.tensorboard_dir={tb}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    assert drive(d, *overrides(str(d / "ckpt"), d / "tb")).code == exitcodes.COMPLETED
    return tb_scalars(d / "tb")


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS variables of the session's S3 server in this process's environment; `use(endpoint)` points them
    elsewhere (a fault proxy)."""
    def use(endpoint: str | None = None):
        for key, value in s3_server.env(endpoint).items():
            monkeypatch.setenv(key, value)
    use()
    return use


def s3_url(s3_server) -> str:
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:8]}/job"


def assert_continues_exactly(tb, reference, after: int):
    loss = tb_scalars(tb)
    assert {i: loss[i] for i in range(after + 1, ITERS + 1)} == {i: reference[i] for i in range(after + 1, ITERS + 1)}


def resume(tmp_path, store: str, reference, expect: int, *extra: str):
    """The run after: it resumes from iteration `expect` and continues the uninterrupted run's losses exactly."""
    out = drive(tmp_path, *overrides(store, tmp_path / "tb", *extra))
    assert out.code == exitcodes.COMPLETED
    assert out.driver.of(Started)[0].iteration == expect
    assert_continues_exactly(tmp_path / "tb", reference, expect)
    return out


@pytest.mark.parametrize("backend,point,expect", [
    ("fs", "after-payload", 10),   # files written, no commit marker: iteration 20 is invisible
    # committed, tracker not yet moved: a resume follows the tracker while it points at a committed checkpoint
    # (checkpoint.layout.resolve_checkpoint; a rolled-back run's older timeline may hold newer committed ones)
    ("fs", "after-commit", 10),
    ("s3", "after-tracker", 20),   # durable, progress log not yet appended
])
def test_a_save_stopped_midway_is_invisible_until_committed(reference, tmp_path, s3_server, s3_env, backend, point,
                                                            expect):
    store = str(tmp_path / "ckpt") if backend == "fs" else s3_url(s3_server)
    with pytest.raises(SaveStopped):
        drive(tmp_path, *overrides(store, tmp_path / "tb"), driver=Driver().stop_save_at(point, 20))
    # the operator's view: progress.txt only lists checkpoints that were complete
    assert summarize(store)["lastCheckpoint"]["iteration"] == 10
    resume(tmp_path, store, reference, expect)


@pytest.mark.process
def test_sigkill_mid_upload_leaves_only_the_previous_checkpoint(reference, tmp_path, s3_server):
    """A real process killed (SIGKILL, KUBETRON_CHAOS_KILL_AT) with its shard's data uploaded and its index not."""
    store = s3_url(s3_server)
    env = s3_server.env()
    p = run(["train", "--config", TINY, *overrides(store, tmp_path / "tb")], tmp_path,
            KUBETRON_CHAOS_KILL_AT="after-shard@20", **env)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    p = run(["progress", store, "--json"], tmp_path, **env)
    assert json.loads(p.stdout)["lastCheckpoint"]["iteration"] == 10
    p = run(["train", "--config", TINY, *overrides(store, tmp_path / "tb")], tmp_path, **env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "at iteration 10" in p.stdout, p.stdout[-2000:]
    assert_continues_exactly(tmp_path / "tb", reference, 10)


def test_sigterm_and_resume_from_s3_is_bit_exact(reference, tmp_path, s3_server, s3_env):
    store = s3_url(s3_server)
    out = drive(tmp_path, *overrides(store, tmp_path / "tb"), driver=Driver().signal_at(13))
    assert out.code == exitcodes.SAVED_ON_SIGNAL and out.termination["lastCheckpoint"] == 13
    summary = summarize(store)
    assert summary["lastCheckpoint"]["iteration"] == 13 and summary["lastExit"]["reason"] == "SavedOnSignal"
    resume(tmp_path, store, reference, 13)
    assert summarize(store)["completed"] is True


def test_s3_faults_are_retried_and_never_visible(reference, tmp_path, s3_server, s3_env):
    """503s, resets (before and after the server acted) and slow answers on a share of requests."""
    store = s3_url(s3_server)
    with FaultProxy(s3_server.endpoint, p_503=0.08, p_reset=0.04, p_reset_after=0.04, p_delay=0.04,
                    delay_s=0.2, seed=7) as px:
        s3_env(px.endpoint)
        assert drive(tmp_path, *overrides(store, tmp_path / "tb")).code == exitcodes.COMPLETED
        assert px.stats["503"] + px.stats["reset"] + px.stats["reset_after"] > 0
    s3_env()
    # every iteration the store shows is complete and loads
    out = drive(tmp_path, *COMMON, f"checkpoint.load={store}", "checkpoint.ckpt_step=20", "checkpoint.save=null",
                f"logger.tensorboard_dir={tmp_path}/tb2")
    assert out.code == exitcodes.COMPLETED and out.driver.of(Started)[0].iteration == 20
    assert_continues_exactly(tmp_path / "tb2", reference, 20)


def test_s3_save_that_keeps_failing_fails_loudly_and_the_tracker_stays(reference, tmp_path, s3_server, s3_env,
                                                                         monkeypatch):
    store = s3_url(s3_server)
    only_iter_20 = lambda method, path: method in ("PUT", "POST") and "iter_0000020" in path  # noqa: E731
    with FaultProxy(s3_server.endpoint, p_503=1.0, match=only_iter_20) as px:
        s3_env(px.endpoint)
        monkeypatch.setenv("KUBETRON_S3_MAX_ATTEMPTS", "2")
        monkeypatch.setenv("KUBETRON_S3_OUTER_ATTEMPTS", "1")
        monkeypatch.setenv("KUBETRON_S3_OUTAGE_SECONDS", "0")
        out = drive(tmp_path, *overrides(store, tmp_path / "tb"))
    assert out.code == exitcodes.ERROR
    assert "iter_0000020" in out.termination["message"] and out.termination["lastCheckpoint"] == 10
    s3_env()
    monkeypatch.delenv("KUBETRON_S3_MAX_ATTEMPTS")
    monkeypatch.delenv("KUBETRON_S3_OUTER_ATTEMPTS")
    monkeypatch.delenv("KUBETRON_S3_OUTAGE_SECONDS")
    assert summarize(store)["lastCheckpoint"]["iteration"] == 10
    resume(tmp_path, store, reference, 10)


@pytest.mark.parametrize("backend", ["fs", "s3"])
def test_async_save_with_sigterm(reference, tmp_path, s3_server, s3_env, backend):
    store = str(tmp_path / "ckpt") if backend == "fs" else s3_url(s3_server)
    out = drive(tmp_path, *overrides(store, tmp_path / "tb", "checkpoint.async_save=true"),
                driver=Driver().signal_at(12))
    assert out.code == exitcodes.SAVED_ON_SIGNAL
    summary = summarize(store)
    assert "Saved async checkpoint" in [e["event"] for e in summary["events"]]  # the save at 10, in the background
    assert summary["lastCheckpoint"]["iteration"] == out.termination["lastCheckpoint"] == 12
    resume(tmp_path, store, reference, 12, "checkpoint.async_save=true")


@pytest.mark.parametrize("kind", ["global", "local"])
def test_resume_takes_the_newest_of_persistent_and_non_persistent(reference, tmp_path, kind):
    store = tmp_path / "ckpt"
    extra = ["checkpoint.non_persistent_save_interval=5", f"checkpoint.non_persistent_ckpt_type={kind}"]
    if kind == "local":
        extra.append(f"checkpoint.non_persistent_local_ckpt_dir={tmp_path / 'local'}")
    with pytest.raises(SaveStopped):
        drive(tmp_path, *overrides(str(store), tmp_path / "tb", *extra),
              driver=Driver().stop_save_at("after-payload", 20))
    if kind == "global":
        np_dir = store / "non_persistent"
        assert sorted(d.name for d in np_dir.iterdir() if d.name.startswith("iter_")) == ["iter_0000015"]
    else:  # snapshots in memory: at most two, the newest two (docs/recovery.md)
        snaps = tmp_path / "local" / "own" / "rank_00000"
        assert sorted(d.name for d in snaps.iterdir() if d.name.startswith("snap_")) == ["snap_0000010",
                                                                                          "snap_0000015"]
    resume(tmp_path, str(store), reference, 15, *extra)


def test_snapshots_that_fail_their_checks_before_the_first_checkpoint_are_reported(reference, tmp_path):
    """Killed in its first durable save (the store holds no complete checkpoint), with every memory snapshot then
    corrupted: the next start loads nothing and trains from iteration 0 as an uninterrupted run does, and says so
    (rank 0's `recovery`: from the store at 0, failed, why), so that the operator records it and warns
    (docs/recovery.md); before, it started afresh without a word."""
    from kubetron.storage import snapshot_files as sf

    store, local = tmp_path / "ckpt", tmp_path / "local"
    extra = ["checkpoint.non_persistent_save_interval=4", "checkpoint.non_persistent_ckpt_type=local",
             f"checkpoint.non_persistent_local_ckpt_dir={local}"]
    with pytest.raises(SaveStopped):
        drive(tmp_path, *overrides(str(store), tmp_path / "tb", *extra),
              driver=Driver().stop_save_at("after-payload", 10))
    shards = sorted(sf.own_dir(local, 0).glob("snap_*/shards/rank_00000.bin"))
    assert [p.parent.parent.name for p in shards] == ["snap_0000004", "snap_0000008"]
    for shard in shards:  # one byte changed: the checksums no longer match
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    out = resume(tmp_path, str(store), reference, 0, *extra)
    recovery = out.driver.of(Started)[0].recovery
    assert recovery is not None and "do not match their checksum" in recovery.pop("reason"), recovery
    assert recovery == {"loadedFrom": "store", "iteration": 0, "seconds": recovery["seconds"], "failed": True,
                        "restart": 0}


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("backend", ["fs", "s3"])
def test_torch_dist_format_sigterm_resume_is_exact(reference, tmp_path, s3_server, s3_env, backend):
    """ckpt_format=torch_dist (megatron-core dist_checkpointing, staged through the store): SIGTERM and
    resume continue the reference exactly; the checkpoint is a torch_dist directory under dist/. The
    resume on a path runs with the default format: the format is read from the checkpoint."""
    store = str(tmp_path / "ckpt") if backend == "fs" else s3_url(s3_server)
    fmt = "checkpoint.ckpt_format=torch_dist"
    out = drive(tmp_path, *overrides(store, tmp_path / "tb", fmt), driver=Driver().signal_at(13))
    assert out.code == exitcodes.SAVED_ON_SIGNAL and out.termination["lastCheckpoint"] == 13
    resume(tmp_path, store, reference, 13, *([fmt] if backend == "s3" else []))
    if backend == "fs":
        d = tmp_path / "ckpt" / "iter_0000010"
        assert json.loads((d / "dist" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        assert (d / "dist" / ".metadata").is_file() and not (d / "model.pt").exists()


def test_torch_dist_planted_metadata_pickle_is_refused(tmp_path, capsys):
    """torch DCP reads .metadata with plain pickle.load; kubetron checks it against an allow-list first."""
    store = tmp_path / "ckpt"
    out = drive(tmp_path, *overrides(str(store), tmp_path / "tb", "checkpoint.ckpt_format=torch_dist",
                                     "train.train_iters=20"))
    assert out.code == exitcodes.COMPLETED
    marker = tmp_path / "PWNED"
    (store / "iter_0000020" / "dist" / ".metadata").write_bytes(pickle.dumps({"x": _Payload(marker)}))
    capsys.readouterr()
    out = drive(tmp_path, *overrides(str(store), tmp_path / "tb"))
    err = capsys.readouterr().err
    assert out.code == exitcodes.ERROR
    assert not marker.exists(), "the pickle payload ran"
    assert "Traceback" not in err
    assert "refusing to load" in err and "iter_0000020/dist/.metadata" in err, err[-2000:]
    assert "io.open is not allowed in checkpoint metadata" in out.termination["message"]
