"""kubetron.contract.progress (the progress-log format, shared by trainer and operator), the trainer's
kubetron.progress_io (reading a store's log, `kubetron progress`) and the status endpoint."""

from __future__ import annotations

import json
import socket
import sys
import types
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest
from kubetron.contract.progress import (
    PROGRESS_FILE,
    ProgressEvent,
    exiting_job_line,
    format_line,
    get_start_time_from_progress_log,
    last_checkpoint_flops,
    parse_progress,
    saved_checkpoint_line,
    starting_job_line,
    summarize_events,
)
from kubetron.contract.termination import MESSAGE_LIMIT
from kubetron.supervisor import progress_io
from kubetron.supervisor.progress_io import read_progress_text, summarize
from kubetron.training.status_server import StatusServer, status_server_from_env

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)


def at(minute: int, second: int = 0) -> datetime:
    return T0.replace(minute=minute, second=second)


# --------------------------------------------------------------------------------------------------
# Format


def test_format_line_matches_contract_example():
    line = format_line(
        "Starting job",
        job_id="ns/job/1",
        num_gpus=2,
        fields={"Iteration": 0, "Train iters": 40},
        now=T0,
    )
    assert (
        line
        == "2026-11-22 12:00:00\tJob ID: ns/job/1\t# GPUs: 2\tStarting job\tIteration: 0\tTrain iters: 40"
    )


def test_saved_checkpoint_line_matches_contract_example():
    line = saved_checkpoint_line(
        10, 0.1, 0.1, 1.23e12, 20480, 40, num_gpus=2, job_id="ns/job/1", now=at(0, 9)
    )
    assert line == (
        "2026-11-22 12:00:09\tJob ID: ns/job/1\t# GPUs: 2\tSaved checkpoint\tIteration: 10\t"
        "Job throughput: 0.1 TFLOP/s/GPU\tCumulative throughput: 0.1 TFLOP/s/GPU\t"
        "Floating-point operations: 1.23e+12\tTokens (in billions): 0.00\tTokens: 20480\tTrain iters: 40"
    )
    async_line = saved_checkpoint_line(12, 0.1, 0.1, 1.5e12, 24576, 40, async_save=True, num_gpus=2, job_id="",
                                       now=T0)
    assert "\tSaved async checkpoint\tIteration: 12\t" in async_line


def test_exiting_job_line_and_job_id_from_env(monkeypatch):
    monkeypatch.setenv("KUBETRON_JOB_ID", "ns/job/3")
    assert progress_io.job_id() == "ns/job/3"
    line = exiting_job_line(12, "SavedOnSignal", 40, num_gpus=2, job_id=progress_io.job_id(), now=at(0, 12))
    assert line == (
        "2026-11-22 12:00:12\tJob ID: ns/job/3\t# GPUs: 2\tExiting job\tIteration: 12\t"
        "Reason: SavedOnSignal\tTrain iters: 40"
    )
    monkeypatch.delenv("KUBETRON_JOB_ID")
    assert progress_io.job_id() == ""
    assert "\tJob ID: \t# GPUs: 2\t" in starting_job_line(0, 40, num_gpus=2, job_id=progress_io.job_id(), now=T0)


def test_format_uses_utc_and_sanitizes_tabs():
    from datetime import timedelta, timezone

    local = datetime(2026, 11, 22, 14, 0, 0, tzinfo=timezone(timedelta(hours=2)))
    line = format_line("Note", job_id="a\tb", num_gpus=1, fields={"Msg": "x\ny\tz"}, now=local)
    assert line.startswith("2026-11-22 12:00:00\t")
    assert "\n" not in line
    (ev,) = parse_progress(line)
    assert ev.job_id == "a b"
    assert ev.fields == {"Msg": "x y z"}


def test_round_trip():
    lines = [
        starting_job_line(0, 40, num_gpus=2, job_id="ns/job/1", now=T0),
        saved_checkpoint_line(
            10, 12.34, 11.0, 1.23e12, 20480, 40, num_gpus=2, job_id="ns/job/1", now=at(0, 9)
        ),
        exiting_job_line(10, "Completed", 40, num_gpus=2, job_id="ns/job/1", now=at(0, 12)),
    ]
    events = parse_progress("\n".join(lines) + "\n")
    assert [e.event for e in events] == ["Starting job", "Saved checkpoint", "Exiting job"]
    start, ckpt, exit_ = events
    assert start == ProgressEvent(
        time=T0,
        job_id="ns/job/1",
        num_gpus=2,
        event="Starting job",
        fields={"Iteration": "0", "Train iters": "40"},
    )
    assert start.time.tzinfo is not None
    assert ckpt.iteration == 10 and ckpt.train_iters == 40 and ckpt.is_checkpoint
    assert list(ckpt.fields) == [
        "Iteration",
        "Job throughput",
        "Cumulative throughput",
        "Floating-point operations",
        "Tokens (in billions)",
        "Tokens",
        "Train iters",
    ]
    assert ckpt.fields["Job throughput"] == "12.3 TFLOP/s/GPU"
    assert ckpt.fields["Floating-point operations"] == "1.23e+12"
    assert ckpt.fields["Tokens"] == "20480"
    assert exit_.fields["Reason"] == "Completed"
    # And each line alone re-formats identically.
    for line, ev in zip(lines, events):
        assert (
            format_line(ev.event, job_id=ev.job_id, num_gpus=ev.num_gpus, fields=ev.fields, now=ev.time)
            == line
        )


# --------------------------------------------------------------------------------------------------
# A realistic log


def multi_job_log() -> str:
    """Job 1 on 2 GPUs is preempted; job 2 on 4 GPUs is preempted; job 3 on 4 GPUs completes."""
    j1, j2, j3 = "ns/job/1", "ns/job/2", "ns/job/3"
    lines = [
        starting_job_line(0, 40, num_gpus=2, job_id=j1, now=at(0, 0)),
        saved_checkpoint_line(10, 0.1, 0.1, 1.23e12, 20480, 40, num_gpus=2, job_id=j1, now=at(0, 9)),
        saved_checkpoint_line(
            12, 0.2, 0.15, 1.5e12, 24576, 40, async_save=True, num_gpus=2, job_id=j1, now=at(0, 11)
        ),
        exiting_job_line(12, "SavedOnSignal", 40, num_gpus=2, job_id=j1, now=at(0, 12)),
        "",
        "2026-11-22 12:04:00\tJob ID: ns/job/2\t# GPUs: 4\tStarting jo",  # torn write of a crash
        "garbage line without tabs",
        "not-a-time\tJob ID: x\t# GPUs: 4\tStarting job\tIteration: 0",
        "2026-11-22 12:04:30\tJob ID: x\t# GPUs: four\tStarting job\tIteration: 0",
        starting_job_line(12, 40, num_gpus=4, job_id=j2, now=at(5, 0)),
        format_line(
            "Straggler report", job_id=j2, num_gpus=4, fields={"Rank": 3, "Slowdown": "1.5x"}, now=at(5, 10)
        ),
        saved_checkpoint_line(
            20, 1.0, 0.5, 2.5e12, 40960, 40, async_save=True, num_gpus=4, job_id=j2, now=at(5, 30)
        ),
        exiting_job_line(20, "SavedOnSignal", 40, num_gpus=4, job_id=j2, now=at(5, 31)),
        starting_job_line(20, 40, num_gpus=4, job_id=j3, now=at(10, 0)),
        saved_checkpoint_line(30, 1.1, 0.7, 3.75e12, 61440, 40, num_gpus=4, job_id=j3, now=at(10, 20))
        + "\tSome future key: 7",
        saved_checkpoint_line(40, 1.2, 0.8, 5.0e12, 81920, 40, num_gpus=4, job_id=j3, now=at(10, 40)),
        exiting_job_line(40, "Completed", 40, num_gpus=4, job_id=j3, now=at(10, 41)),
    ]
    return "\n".join(lines) + "\n"


def test_summarize_multi_job_log():
    events = parse_progress(multi_job_log())
    assert len(events) == 13  # garbled lines dropped, the unknown event kept in the list
    s = summarize_events(events)
    assert s["lastCheckpoint"] == {"iteration": 40, "time": "2026-11-22T12:10:40Z"}
    assert s["trainIters"] == 40
    assert s["iteration"] == 40
    assert s["tokens"] == 81920
    assert s["floatingPointOperations"] == pytest.approx(5.0e12)
    assert s["jobThroughput"] == pytest.approx(1.2)
    assert s["cumulativeThroughput"] == pytest.approx(0.8)
    assert s["jobs"] == 3
    assert s["startTime"] == "2026-11-22T12:00:00Z"
    assert s["completed"] is True
    assert s["lastExit"] == {"iteration": 40, "reason": "Completed", "time": "2026-11-22T12:10:41Z"}
    assert s["events"][0] == {
        "time": "2026-11-22T12:00:00Z",
        "jobId": "ns/job/1",
        "gpus": 2,
        "event": "Starting job",
        "fields": {"Iteration": "0", "Train iters": "40"},
    }
    assert any(e["event"] == "Straggler report" for e in s["events"])
    json.dumps(s)  # JSON-ready


def test_summarize_mid_run_after_preemption():
    text = multi_job_log()
    cut = text.index("Job ID: ns/job/3")
    text = text[: text.rindex("\n", 0, cut) + 1]
    s = summarize_events(parse_progress(text))
    assert s["lastCheckpoint"] == {"iteration": 20, "time": "2026-11-22T12:05:30Z"}
    assert s["tokens"] == 40960
    assert s["jobs"] == 2
    assert s["completed"] is False
    assert s["lastExit"] == {"iteration": 20, "reason": "SavedOnSignal", "time": "2026-11-22T12:05:31Z"}
    # A new job has started: the iteration is where it resumed, the old exit is still reported.
    text += starting_job_line(20, 40, num_gpus=4, job_id="ns/job/3", now=at(10)) + "\n"
    s = summarize_events(parse_progress(text))
    assert s["iteration"] == 20 and s["jobs"] == 3 and s["completed"] is False
    assert s["jobIterations"]["ns/job/3"] == 20 and set(s["jobIterations"]) == {"ns/job/1", "ns/job/2", "ns/job/3"}


def test_completed_rules():
    # A checkpoint at train_iters completes even without an Exiting job line (crash after the final save).
    text = "\n".join(
        [
            starting_job_line(0, 20, num_gpus=1, job_id="j", now=T0),
            saved_checkpoint_line(20, 1, 1, 1e12, 100, 20, num_gpus=1, job_id="j", now=at(1)),
        ]
    )
    assert summarize_events(parse_progress(text))["completed"] is True
    # Raising train_iters in a later job un-completes it.
    text += "\n" + starting_job_line(20, 40, num_gpus=1, job_id="j2", now=at(2))
    s = summarize_events(parse_progress(text))
    assert s["completed"] is False and s["trainIters"] == 40
    # An Exiting job Completed ends it; an exit for another reason does not.
    assert (
        summarize_events(
            parse_progress(exiting_job_line(25, "ExitCondition", 40, num_gpus=1, job_id="j2", now=at(3)))
        )["completed"]
        is False
    )
    assert (
        summarize_events(
            parse_progress(exiting_job_line(40, "Completed", 40, num_gpus=1, job_id="j2", now=at(3)))
        )["completed"]
        is True
    )


def test_empty_and_megatron_native_lines():
    s = summarize_events(parse_progress(""))
    assert s["lastCheckpoint"] is None and s["lastExit"] is None and s["startTime"] is None
    assert s["jobs"] == 0 and s["completed"] is False and s["events"] == [] and s["tokens"] is None
    # Megatron's own lines: bare "Starting job", and a checkpoint without the exact Tokens key.
    text = (
        "2026-11-22 12:00:00\tJob ID: 123\t# GPUs: 8\tStarting job\n"
        "2026-11-22 12:30:00\tJob ID: 123\t# GPUs: 8\tSaved checkpoint\tIteration: 500\t"
        "Job throughput: 400.5 TFLOP/s/GPU\tCumulative throughput: 390.0 TFLOP/s/GPU\t"
        "Floating-point operations: 7.00e+18\tTokens (in billions): 2.10\n"
    )
    s = summarize_events(parse_progress(text))
    assert s["lastCheckpoint"]["iteration"] == 500
    assert s["tokens"] == 2_100_000_000
    assert s["jobThroughput"] == pytest.approx(400.5)
    assert s["trainIters"] is None and s["completed"] is False


def test_garbled_lines_ignored():
    good = starting_job_line(0, 40, num_gpus=2, job_id="j", now=T0)
    text = "\n".join(
        [
            "",
            "   ",
            "\t\t\t",
            "2026-13-45 99:00:00\tJob ID: j\t# GPUs: 2\tStarting job",
            "2026-11-22 12:00:00\tJob: j\t# GPUs: 2\tStarting job",
            "2026-11-22 12:00:00\tJob ID: j\tGPUs 2\tStarting job",
            "2026-11-22 12:00:00\tJob ID: j\t# GPUs: 2\t",
            "2026-11-22 12:00:00\tJob ID: j\t# GPUs: 2",
            "\x00\x01binary\xff",
            good + "\tnot a pair\t: empty key\tIteration: also",
            "2026-11-22 12:00:05\tJob ID: j\t# GPUs: 2\tSaved checkpoint\tIteration: ten\tTokens: many",
        ]
    )
    events = parse_progress(text)
    assert [e.event for e in events] == ["Starting job", "Saved checkpoint"]
    assert events[0].fields == {"Iteration": "also", "Train iters": "40"}  # the last duplicate key wins
    s = summarize_events(events)
    assert s["lastCheckpoint"] is None  # a checkpoint without a readable iteration is not one
    assert s["jobs"] == 1 and s["iteration"] is None


def test_crlf_and_missing_final_newline():
    text = multi_job_log().replace("\n", "\r\n").rstrip("\r\n")
    assert summarize_events(parse_progress(text))["lastCheckpoint"]["iteration"] == 40


# --------------------------------------------------------------------------------------------------
# get_start_time_from_progress_log


def test_get_start_time_same_gpus_continues():
    text = multi_job_log()
    # Jobs 2 and 3 ran on 4 GPUs in a row: the earliest of them, and the FLOPs saved before it started.
    start, flops = get_start_time_from_progress_log(text, 4)
    assert start == at(5, 0)
    assert flops == pytest.approx(1.5e12)  # the async checkpoint of job 1 counts
    # 2 GPUs: the 4-GPU lines that followed broke the run.
    assert get_start_time_from_progress_log(text, 2) == (None, 0.0)
    assert last_checkpoint_flops(text) == pytest.approx(5.0e12)


def test_get_start_time_resets_on_gpu_change_and_back():
    text = "\n".join(
        [
            starting_job_line(0, 100, num_gpus=2, job_id="a", now=at(0)),
            saved_checkpoint_line(10, 1, 1, 1e12, 10, 100, num_gpus=2, job_id="a", now=at(1)),
            starting_job_line(10, 100, num_gpus=2, job_id="b", now=at(2)),
            saved_checkpoint_line(20, 1, 1, 2e12, 20, 100, num_gpus=2, job_id="b", now=at(3)),
            starting_job_line(20, 100, num_gpus=8, job_id="c", now=at(4)),
            saved_checkpoint_line(30, 1, 1, 3e12, 30, 100, num_gpus=8, job_id="c", now=at(5)),
            starting_job_line(30, 100, num_gpus=2, job_id="d", now=at(6)),
            saved_checkpoint_line(40, 1, 1, 4e12, 40, 100, num_gpus=2, job_id="d", now=at(7)),
            starting_job_line(40, 100, num_gpus=2, job_id="e", now=at(8)),
        ]
    )
    assert get_start_time_from_progress_log(text, 2) == (at(6), pytest.approx(3e12))
    assert get_start_time_from_progress_log(text, 8) == (None, 0.0)
    head = text.split("\n")[:4]
    assert get_start_time_from_progress_log("\n".join(head), 2) == (at(0), 0.0)
    assert get_start_time_from_progress_log("", 2) == (None, 0.0)


# --------------------------------------------------------------------------------------------------
# I/O


def test_read_local_dir_and_file(tmp_path):
    assert read_progress_text(str(tmp_path)) == ""
    assert read_progress_text(str(tmp_path / "missing")) == ""
    assert read_progress_text(str(tmp_path / "progress.txt")) == ""
    (tmp_path / "progress.txt").write_text(multi_job_log())
    for location in (
        str(tmp_path),
        str(tmp_path) + "/",
        str(tmp_path / "progress.txt"),
        f"file://{tmp_path}",
    ):
        assert read_progress_text(location) == multi_job_log()
        s = summarize(location)
        assert s["store"] == location
        assert s["lastCheckpoint"]["iteration"] == 40 and s["completed"] is True
    empty = summarize(str(tmp_path / "nothing-here"))
    assert empty["lastCheckpoint"] is None and empty["jobs"] == 0


class FakeStore:
    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.read: list[str] = []

    def exists(self, key: str) -> bool:
        return key in self.files

    def read_bytes(self, key: str) -> bytes:
        self.read.append(key)
        return self.files[key]


def test_read_with_store_and_s3(monkeypatch):
    data = multi_job_log().encode()
    store = FakeStore({"progress.txt": data})
    assert read_progress_text("ignored", store=store) == multi_job_log()
    assert read_progress_text("ignored", store=FakeStore({})) == ""

    opened: list[str] = []

    def open_store(url: str) -> FakeStore:
        opened.append(url)
        return FakeStore({"progress.txt": data} if url == "s3://bucket/runs/a" else {})

    fake = types.ModuleType("kubetron.storage")
    fake.open_store = open_store
    monkeypatch.setitem(sys.modules, "kubetron.storage", fake)
    s = summarize("s3://bucket/runs/a")
    assert s["store"] == "s3://bucket/runs/a" and s["lastCheckpoint"]["iteration"] == 40
    assert read_progress_text("s3://bucket/runs/a/progress.txt") == multi_job_log()
    assert read_progress_text("s3://bucket/runs/b") == ""
    assert opened == ["s3://bucket/runs/a", "s3://bucket/runs/a", "s3://bucket/runs/b"]


def test_cli_main(tmp_path, capsys):
    (tmp_path / "progress.txt").write_text(multi_job_log())
    assert progress_io.main([str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lastCheckpoint"]["iteration"] == 40 and "events" in out
    assert progress_io.main(["--no-events", str(tmp_path)]) == 0
    assert "events" not in json.loads(capsys.readouterr().out)
    assert progress_io.main([]) == 2


# --------------------------------------------------------------------------------------------------
# Status server


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_status_server_serves_prometheus_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    with StatusServer(0, host="127.0.0.1") as server:
        base = f"http://127.0.0.1:{server.port}"
        assert get(base + "/metrics") == (200, "\n")  # nothing known yet: no made-up zeros
        saved = datetime.now(UTC) - timedelta(seconds=90)
        server.update(iteration=12, trainIters=40, loss=float("nan"), learningRate=3e-4, tokensPerSecond=1234.5,
                      tflopsPerGpu=101.25, lastCheckpoint={"iteration": 10, "time": saved.isoformat()},
                      checkpointSaveSeconds=2.5, checkpointBlockedSeconds=0.25)
        code, text = get(base + "/metrics")
        assert code == 200
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        age = got.pop("kubetron_trainer_last_checkpoint_age_seconds")
        assert 89 <= age < 150
        assert got == {"kubetron_trainer_iteration": 12.0, "kubetron_trainer_train_iters": 40.0,
                       "kubetron_trainer_learning_rate": 3e-4, "kubetron_trainer_tokens_per_second": 1234.5,
                       "kubetron_trainer_tflops_per_gpu": 101.25, "kubetron_trainer_last_checkpoint_iteration": 10.0,
                       "kubetron_trainer_checkpoint_save_seconds": 2.5,
                       "kubetron_trainer_checkpoint_blocked_seconds": 0.25}


def test_status_server_serves_updates():
    with StatusServer(0, host="127.0.0.1") as server:
        assert server.enabled and server.port and server.port > 0
        base = f"http://127.0.0.1:{server.port}"
        assert server.url == base
        code, body = get(base + "/status")
        assert code == 200
        assert json.loads(body) == {
            "iteration": None,
            "resumedFrom": None,
            "trainIters": None,
            "consumedSamples": None,
            "tokensPerSecond": None,
            "etaSeconds": None,
            "lastCheckpoint": None,
            "loss": None,
            "learningRate": None,
            "tflopsPerGpu": None,
            "inPlaceRestarts": 0,  # not under torchrun, or not restarted
            "hangs": 0,
            "lastHang": None,
            "lastRestart": None,
            "trainerTime": None,  # a server without the trainer's clock
            "checkpointSaveSeconds": None,
            "checkpointBlockedSeconds": None,
        }
        server.update(iteration=12, trainIters=40, consumedSamples=96, tokensPerSecond=1234.5)
        server.update(etaSeconds=30.2, lastCheckpoint={"iteration": 10, "time": "2026-11-22T12:00:09Z"})
        code, body = get(base + "/status")
        assert code == 200
        assert json.loads(body) == {
            "iteration": 12,
            "resumedFrom": None,
            "trainIters": 40,
            "consumedSamples": 96,
            "tokensPerSecond": 1234.5,
            "etaSeconds": 30.2,
            "lastCheckpoint": {"iteration": 10, "time": "2026-11-22T12:00:09Z"},
            "loss": None,
            "learningRate": None,
            "tflopsPerGpu": None,
            "inPlaceRestarts": 0,
            "hangs": 0,
            "lastHang": None,
            "lastRestart": None,
            "trainerTime": None,
            "checkpointSaveSeconds": None,
            "checkpointBlockedSeconds": None,
        }
        server.update(iteration=13, etaSeconds=float("nan"))
        status = json.loads(get(base + "/status?x=1")[1])
        assert status["iteration"] == 13 and status["etaSeconds"] is None
        assert get(base + "/healthz") == (200, "ok")
        assert get(base + "/nope")[0] == 404
    assert server.port is None and not server.enabled
    server.close()  # idempotent
    server.update(iteration=14)  # harmless after close
    with pytest.raises(OSError):
        urllib.request.urlopen(base + "/healthz", timeout=2)


def test_status_server_bind_failure_is_a_warning(caplog):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with caplog.at_level("WARNING"):
            server = StatusServer(port, host="127.0.0.1")
        assert not server.enabled and server.port is None and server.url is None
        assert "status endpoint disabled" in caplog.text
        server.update(iteration=1)
        server.close()
    assert not StatusServer(70000, host="127.0.0.1").enabled


def test_status_server_from_env(monkeypatch):
    monkeypatch.delenv("KUBETRON_STATUS_PORT", raising=False)
    assert status_server_from_env() is None
    monkeypatch.setenv("KUBETRON_STATUS_PORT", "0")
    assert status_server_from_env() is None
    monkeypatch.setenv("KUBETRON_STATUS_PORT", "http")
    assert status_server_from_env() is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    monkeypatch.setenv("KUBETRON_STATUS_PORT", str(free))
    server = status_server_from_env(host="127.0.0.1")
    try:
        assert server is not None and server.port == free
        assert get(f"http://127.0.0.1:{free}/healthz") == (200, "ok")
    finally:
        server.close()


def test_progress_command_writes_its_summary_as_a_termination_message(tmp_path, capsys):
    """A pod that reads a store can report through /dev/termination-log (no pods/log)."""
    store = tmp_path / "store"
    store.mkdir()
    (store / PROGRESS_FILE).write_text(
        saved_checkpoint_line(20, 1.0, 1.0, 1e12, 2048, 40, num_gpus=1, job_id="ml/gpt/1") + "\n")
    message = tmp_path / "termination-log"
    assert progress_io.main(["--no-events", "--termination-log", str(message), str(store)]) == 0
    (line,) = message.read_text().splitlines()
    assert json.loads(line)["lastCheckpoint"]["iteration"] == 20
    assert len(line.encode()) <= MESSAGE_LIMIT
    assert progress_io.main(["--termination-log"]) == 2
    assert "usage" in capsys.readouterr().err


def test_status_server_says_how_often_the_gang_restarted_in_place(monkeypatch):
    """Under torchrun, a restarted gang's rank 0 serves its restart count (the operator's inPlace, docs/recovery.md)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    with StatusServer(0, host="127.0.0.1") as server:
        assert json.loads(get(f"http://127.0.0.1:{server.port}/status")[1])["inPlaceRestarts"] == 2


@pytest.mark.process
def test_progress_command_prints_a_short_summary_and_the_json_with_flag(tmp_path):
    """`kubetron progress STORE`: a few lines a person reads (iteration/train iters, last checkpoint, the last job's
    tokens/s and ETA from its last two checkpoints, restarts); `--json` the summary the operator reads."""
    from kubetron.contract.progress import IN_PLACE_RESTARTS_KEY, RESTARTED_IN_PLACE

    j1, j2 = "ns/job/1", "ns/job/2"
    lines = [starting_job_line(0, 100, num_gpus=8, job_id=j1, now=at(0, 0)),
             saved_checkpoint_line(10, 1.0, 1.0, 1e12, 20480, 100, num_gpus=8, job_id=j1, now=at(1, 40)),
             exiting_job_line(10, "SavedOnSignal", 100, num_gpus=8, job_id=j1, now=at(1, 41)),
             starting_job_line(10, 100, num_gpus=8, job_id=j2, now=at(3, 20)),
             format_line(RESTARTED_IN_PLACE, job_id=j2, num_gpus=8, fields={IN_PLACE_RESTARTS_KEY: 2}, now=at(4, 0)),
             saved_checkpoint_line(20, 1.0, 1.0, 2e12, 40960, 100, num_gpus=8, job_id=j2, now=at(5, 0)),
             saved_checkpoint_line(30, 1.0, 1.0, 3e12, 61440, 100, num_gpus=8, job_id=j2, now=at(5, 50))]
    (tmp_path / PROGRESS_FILE).write_text("\n".join(lines) + "\n")
    from tests.trainer_utils import run

    p = run(["progress", str(tmp_path)], tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        f"{tmp_path}: iteration 30/100 (30%)",
        "  last checkpoint: iteration 30 at 2026-11-22T12:05:50Z",
        "  speed: 410 tokens/s, ETA 5m50s",  # 20480 tokens and 10 iterations in the last 50 s; 70 to go
        "  restarts: 3 (1 new start(s), 2 in place)",
        "  last exit: SavedOnSignal at iteration 10 (2026-11-22T12:01:41Z)"]
    js = run(["progress", str(tmp_path), "--json"], tmp_path)
    summary = json.loads(js.stdout)
    assert summary == {**summarize(str(tmp_path))} and summary["lastCheckpoint"]["iteration"] == 30


def test_status_endpoint_is_refreshed_between_distant_log_intervals():
    """With log_interval steps minutes apart the endpoint still moves at least every STATUS_EVERY seconds
    (so the operator's status stays well inside 60 s of the trainer), from host numbers only: the
    per-iteration losses are never touched between log times (no device sync). A durable checkpoint shows at once."""
    from types import SimpleNamespace

    from kubetron.events import Checkpoint, CheckpointDurable, Events, Started, StepDone
    from kubetron.training import status_server

    clock = [1000.0]
    cfg = SimpleNamespace(
        logger=SimpleNamespace(throughput_window_size=100, log_interval=1000),
        train=SimpleNamespace(train_iters=500, global_batch_size=8), model=SimpleNamespace(seq_length=64))
    updates: list[tuple[float, dict]] = []
    server = SimpleNamespace(update=lambda **f: updates.append((clock[0], f)))
    events = Events([status_server.StatusPublisher(server, cfg, clock=lambda: clock[0])])
    events.emit(Started(100, 500, 800, 0.0, Checkpoint(100, "t100")))
    # before the first step: the resumed position is already known
    assert updates[0][1]["iteration"] == 100 and updates[0][1]["trainIters"] == 500
    assert updates[0][1]["lastCheckpoint"] == {"iteration": 100, "time": "t100"}
    untouchable = object()  # stands for a device tensor: any host read of it would fail
    for step in range(101, 141):
        clock[0] += 3.0  # 3 s per step, log_interval 1000 steps: a console line every 50 minutes
        events.emit(StepDone(step, 3.0, 8 * step, {"lm loss": untouchable}, 1e-3, untouchable, False, None, 1.0))
        if step == 120:
            events.emit(CheckpointDurable(Checkpoint(120, "t120"), clock[0], {}, 2.0, 0.5, True))
            assert updates[-1] == (clock[0], {"lastCheckpoint": {"iteration": 120, "time": "t120"},
                                              "checkpointSaveSeconds": 2.0, "checkpointBlockedSeconds": 0.5})
    times = [t for t, f in updates if "iteration" in f]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) >= 10 and max(gaps) <= status_server.STATUS_EVERY + 3.0
    last = updates[-1][1]
    assert last["iteration"] >= 137 and last["consumedSamples"] == 8 * last["iteration"]
    assert last["tokensPerSecond"] == pytest.approx(8 * 64 / 3.0, rel=1e-3)
    assert last["etaSeconds"] == pytest.approx(3.0 * (500 - last["iteration"]), rel=1e-3)
