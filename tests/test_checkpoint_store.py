"""Checkpoints end to end, on a path and on a real S3 server, through the real `kubetron`.

SIGKILL at several points of a save (KUBETRON_CHAOS_KILL_AT), a fault-injecting proxy in front of
S3, async saves, non-persistent checkpoints, resume from s3:// — each time the run that follows must
resume from the newest *complete* checkpoint and reproduce an uninterrupted run's losses exactly.
"""

from __future__ import annotations

import json
import signal
import uuid

import pytest
from kubetron.contract import exitcodes

from tests.faultproxy import FaultProxy
from tests.trainer_utils import TINY, run, run_until_iteration_then_signal, tb_scalars

ITERS = 30
COMMON = [f"train.train_iters={ITERS}", "checkpoint.save_interval=10", "logger.log_interval=1",
          "validation.eval_interval=null", "checkpoint.most_recent_k=-1"]


def args_for(store: str, tb, *extra):
    return ["train", "--config", TINY, *COMMON, f"checkpoint.save={store}", f"checkpoint.load={store}",
            f"logger.tensorboard_dir={tb}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    p = run(args_for(str(d / "ckpt"), d / "tb"), d)
    assert p.returncode == 0, p.stderr[-3000:]
    return tb_scalars(d / "tb")


def s3_url(s3_server) -> str:
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:8]}/job"


def assert_continues_exactly(tb, reference, after: int):
    loss = tb_scalars(tb)
    assert {i: loss[i] for i in range(after + 1, ITERS + 1)} == {i: reference[i] for i in range(after + 1, ITERS + 1)}


def progress_summary(store: str, tmp_path, env: dict) -> dict:
    p = run(["progress", store, "--json"], tmp_path, **env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("backend,point,expect", [
    ("fs", "after-payload", 10),   # files written, no commit marker: iteration 20 is invisible
    ("fs", "after-commit", 20),    # committed, tracker not yet moved: readers find it by its marker
    ("s3", "after-shard", 10),     # killed mid-save: its shard data uploaded, its index not
    ("s3", "after-tracker", 20),   # durable, progress log not yet appended
])
def test_sigkill_during_save(reference, tmp_path, s3_server, backend, point, expect):
    store = str(tmp_path / "ckpt") if backend == "fs" else s3_url(s3_server)
    env = s3_server.env() if backend == "s3" else {}
    p = run(args_for(store, tmp_path / "tb"), tmp_path, KUBETRON_CHAOS_KILL_AT=f"{point}@20", **env)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    # the operator's view: progress.txt only lists checkpoints that were complete
    assert progress_summary(store, tmp_path, env)["lastCheckpoint"]["iteration"] == 10
    p = run(args_for(store, tmp_path / "tb"), tmp_path, **env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"at iteration {expect}" in p.stdout, p.stdout[-2000:]
    assert_continues_exactly(tmp_path / "tb", reference, expect)


def test_sigterm_and_resume_from_s3_is_bit_exact(reference, tmp_path, s3_server):
    store = s3_url(s3_server)
    env = s3_server.env()
    code, out, err, term = run_until_iteration_then_signal(args_for(store, tmp_path / "tb"), tmp_path, 13, **env)
    assert code == exitcodes.SAVED_ON_SIGNAL, err[-3000:]
    saved = term["lastCheckpoint"]
    summary = progress_summary(store, tmp_path, env)
    assert summary["lastCheckpoint"]["iteration"] == saved and summary["lastExit"]["reason"] == "SavedOnSignal"
    p = run(args_for(store, tmp_path / "tb"), tmp_path, **env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_continues_exactly(tmp_path / "tb", reference, saved)
    assert progress_summary(store, tmp_path, env)["completed"] is True


def test_s3_faults_are_retried_and_never_visible(reference, tmp_path, s3_server):
    """503s, resets (before and after the server acted) and slow answers on a share of requests."""
    store = s3_url(s3_server)
    with FaultProxy(s3_server.endpoint, p_503=0.08, p_reset=0.04, p_reset_after=0.04, p_delay=0.04,
                    delay_s=0.2, seed=7) as px:
        p = run(args_for(store, tmp_path / "tb"), tmp_path, **s3_server.env(px.endpoint))
        assert p.returncode == 0, p.stderr[-3000:]
        assert px.stats["503"] + px.stats["reset"] + px.stats["reset_after"] > 0
    # every iteration the store shows is complete and loads
    q = run(["train", "--config", TINY, *COMMON, f"checkpoint.load={store}", "checkpoint.ckpt_step=20",
             "train.train_iters=30", f"logger.tensorboard_dir={tmp_path}/tb2"], tmp_path, **s3_server.env())
    assert q.returncode == 0, q.stderr[-3000:]
    assert_continues_exactly(tmp_path / "tb2", reference, 20)


def test_s3_save_that_keeps_failing_fails_loudly_and_the_tracker_stays(tmp_path, s3_server):
    store = s3_url(s3_server)
    only_iter_20 = lambda method, path: method in ("PUT", "POST") and "iter_0000020" in path  # noqa: E731
    with FaultProxy(s3_server.endpoint, p_503=1.0, match=only_iter_20) as px:
        p = run(args_for(store, tmp_path / "tb"), tmp_path, KUBETRON_S3_MAX_ATTEMPTS="2",
                KUBETRON_S3_OUTER_ATTEMPTS="1", **s3_server.env(px.endpoint))
    assert p.returncode == exitcodes.ERROR, p.stderr[-2000:]
    assert "iter_0000020" in p.termination["message"] and p.termination["lastCheckpoint"] == 10
    summary = progress_summary(store, tmp_path, s3_server.env())
    assert summary["lastCheckpoint"]["iteration"] == 10
    p = run(args_for(store, tmp_path / "tb"), tmp_path, **s3_server.env())  # resumes from 10
    assert p.returncode == 0 and "at iteration 10" in p.stdout, p.stderr[-2000:]


@pytest.mark.parametrize("backend", ["fs", "s3"])
def test_async_save_with_sigterm(reference, tmp_path, s3_server, backend):
    store = str(tmp_path / "ckpt") if backend == "fs" else s3_url(s3_server)
    env = s3_server.env() if backend == "s3" else {}
    code, out, err, term = run_until_iteration_then_signal(
        args_for(store, tmp_path / "tb", "checkpoint.async_save=true"), tmp_path, 12, **env)
    assert code == exitcodes.SAVED_ON_SIGNAL, err[-3000:]
    summary = progress_summary(store, tmp_path, env)
    events = [e["event"] for e in summary["events"]]
    assert "Saved async checkpoint" in events  # the interval save at 10 went through the background
    assert summary["lastCheckpoint"]["iteration"] == term["lastCheckpoint"]
    p = run(args_for(store, tmp_path / "tb", "checkpoint.async_save=true"), tmp_path, **env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_continues_exactly(tmp_path / "tb", reference, term["lastCheckpoint"])


@pytest.mark.parametrize("kind", ["global", "local"])
def test_resume_takes_the_newest_of_persistent_and_non_persistent(reference, tmp_path, kind):
    store = tmp_path / "ckpt"
    extra = ["checkpoint.non_persistent_save_interval=5", f"checkpoint.non_persistent_ckpt_type={kind}"]
    if kind == "local":
        extra.append(f"checkpoint.non_persistent_local_ckpt_dir={tmp_path / 'local'}")
    p = run(args_for(str(store), tmp_path / "tb", *extra), tmp_path, KUBETRON_CHAOS_KILL_AT="after-payload@20")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    if kind == "global":
        assert sorted(d.name for d in (store / "non_persistent").iterdir() if d.name.startswith("iter_")) == [
            "iter_0000015"]
    else:  # snapshots in memory: at most two, the newest two (docs/recovery.md)
        snaps = tmp_path / "local" / "own" / "rank_00000"
        assert sorted(d.name for d in snaps.iterdir()) == ["snap_0000010", "snap_0000015"]
    p = run(args_for(str(store), tmp_path / "tb", *extra), tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "at iteration 15" in p.stdout, p.stdout[-2000:]
    assert_continues_exactly(tmp_path / "tb", reference, 15)


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("backend", ["fs", "s3"])
def test_torch_dist_format_sigterm_resume_is_exact(reference, tmp_path, s3_server, backend):
    """ckpt_format=torch_dist (megatron-core dist_checkpointing, staged through the store): SIGTERM and
    resume continue the reference exactly; the checkpoint is a torch_dist directory under dist/. The
    resume on a path runs with the default format: the format is read from the checkpoint."""
    store = str(tmp_path / "ckpt") if backend == "fs" else s3_url(s3_server)
    env = s3_server.env() if backend == "s3" else {}
    fmt = "checkpoint.ckpt_format=torch_dist"
    code, out, err, term = run_until_iteration_then_signal(args_for(store, tmp_path / "tb", fmt), tmp_path, 13,
                                                           **env)
    assert code == exitcodes.SAVED_ON_SIGNAL, err[-3000:]
    saved = term["lastCheckpoint"]
    p = run(args_for(store, tmp_path / "tb", *([fmt] if backend == "s3" else [])), tmp_path, **env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"at iteration {saved}" in p.stdout, p.stdout[-2000:]
    assert_continues_exactly(tmp_path / "tb", reference, saved)
    if backend == "fs":
        d = tmp_path / "ckpt" / "iter_0000010"
        assert json.loads((d / "dist" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        assert (d / "dist" / ".metadata").is_file() and not (d / "model.pt").exists()


def test_torch_dist_planted_metadata_pickle_is_refused(tmp_path):
    """torch DCP reads .metadata with plain pickle.load; kubetron checks it against an allow-list first."""
    store = tmp_path / "ckpt"
    p = run(args_for(str(store), tmp_path / "tb", "checkpoint.ckpt_format=torch_dist", "train.train_iters=20"),
            tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    marker = tmp_path / "PWNED"
    import pickle

    (store / "iter_0000020" / "dist" / ".metadata").write_bytes(pickle.dumps({"x": _Payload(marker)}))
    p = run(args_for(str(store), tmp_path / "tb"), tmp_path)
    assert p.returncode == exitcodes.ERROR, p.stderr[-3000:]
    assert not marker.exists(), "the pickle payload ran"
    assert "Traceback" not in p.stderr
    assert "refusing to load" in p.stderr and "iter_0000020/dist/.metadata" in p.stderr, p.stderr[-2000:]
    assert "io.open is not allowed in checkpoint metadata" in p.termination["message"]
