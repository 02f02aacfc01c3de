"""Hang detection (docs/recovery.md): the rules (kubetron.contract.hang), the heartbeat a rank
publishes (kubetron.heartbeat), the watchdog that reads it from outside the rank (kubetron.watchdog, with real
processes and a stand-in for the rendezvous store), and two pods' real launchers and torchrun on CPU:

- a SIGSTOPped rank (it cannot even dump its stack) is named within the hang timeout, every rank's stacks go to
  the store, the gang restarts in place from the newest checkpoint and completes; with no in-place restart
  left the pods end with exit 7 (Hung) and a termination message naming the rank;
- a deliberately slow checkpoint store (every write answered seconds late, saves far slower than the hang
  timeout) is never taken for a hang.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from kubetron.compat.torch import elastic
from kubetron.contract import exitcodes, hang
from kubetron.contract.hang import CHECKPOINT, EVALUATION, HANGS_ENV, STARTUP, TEARDOWN, TRAIN, Beat
from kubetron.events import PROGRESS, Events, PhaseEntered, Started, StepDone, Stopping
from kubetron.supervisor import heartbeat, torchrun, watchdog
from kubetron.supervisor.heartbeat import Heartbeat

from tests.faultproxy import FaultProxy
from tests.multirank.launchers import run_to_end, start_pods
from tests.multirank.runner import fault_at
from tests.rendezvous_store import Store
from tests.trainer_utils import QUICK, TINY

pytestmark = pytest.mark.process

# -- the rules --------------------------------------------------------------------------------------------


def beat(phase=TRAIN, idle=0.0, slowest=0.1, steps=10, now=1000.0):
    return Beat(seq=1, iteration=35, phase=phase, pid=1, phase_since=now - idle, progress_at=now - idle,
                slowest_step=slowest, steps=steps)


@pytest.mark.parametrize(("b", "override", "timeout"), [
    (beat(), None, hang.FLOOR_SECONDS),  # a fast step: the floor
    (beat(slowest=20.0), None, 100.0),  # 5 x the slowest recent iteration
    (beat(), 20.0, 20.0),  # spec.hangTimeoutSeconds
    (beat(CHECKPOINT), 20.0, 200.0),  # a checkpoint save: 10 x
    (beat(EVALUATION, slowest=20.0), None, 1000.0),  # an evaluation: 10 x
    (beat(steps=1), 20.0, 200.0),  # a process's first iterations: 10 x
    (beat(steps=0), 20.0, None),  # its first one is start-up's last part: not judged
    (beat(STARTUP), 20.0, None), (beat(hang.DATA), 20.0, None), (beat(hang.TEARDOWN), 20.0, None),
    (beat(), 0.0, None),  # hangTimeoutSeconds 0: off
], ids=["floor", "5x step", "override", "checkpoint", "evaluation", "warm-up", "first step", "startup", "data",
        "teardown", "off"])
def test_the_hang_timeout_follows_the_job_and_its_phase(b, override, timeout):
    assert hang.hang_timeout(b, override) == timeout
    if timeout is not None:
        assert not hang.stalled(b, override, now=1000.0 + timeout - 0.1 - b.idle(1000.0))
        assert hang.stalled(beat(b.phase, idle=timeout + 0.1, slowest=b.slowest_step, steps=b.steps), override,
                            now=1000.0)


def test_a_torn_or_garbled_record_is_not_read():
    record = hang.encode_beat(beat())
    assert hang.decode_beat(record) == beat()
    torn = record[:-8] + (2).to_bytes(8, "little")  # the writer was between the two sequence numbers
    assert hang.decode_beat(torn) is None and hang.decode_beat(record[:10]) is None
    assert hang.parse_timeout("20") == 20.0 and hang.parse_timeout("0") == 0.0
    assert hang.parse_timeout("soon") is None and hang.parse_timeout("-1") is None and hang.parse_timeout(None) is None


def test_the_rank_named_is_the_stopped_one_then_the_one_outside_a_collective():
    def state(rank, how, idle=50.0):
        return hang.RankState(rank=rank, nodeRank=rank, localRank=0, phase=TRAIN, iteration=35, idleSeconds=idle,
                              timeoutSeconds=45.0, stalled=True, state=how, where="")

    waiting = [state(0, hang.COLLECTIVE, 60.0), state(2, hang.COLLECTIVE)]
    assert hang.choose([*waiting, state(1, hang.ELSEWHERE), state(3, hang.STOPPED, 10.0)])["rank"] == 3
    assert hang.choose([*waiting, state(1, hang.ELSEWHERE)])["rank"] == 1
    assert hang.choose([*waiting, state(1, hang.UNRESPONSIVE), state(3, hang.ELSEWHERE)])["rank"] == 1
    assert hang.choose(waiting)["rank"] == 0  # all in collectives: the one idle longest
    report = hang.report([*waiting, state(1, hang.STOPPED)], "s3://b/x/hangs/1-1/", 1)
    assert report["rank"] == 1 and report["ranks"] == 3 and hang.parse_report(json.loads(json.dumps(report))) == report
    assert "rank 1 (pod rank 1) hung: no progress for 50 s (timeout 45 s) in phase train after iteration 35 " \
           "(stopped: it could not dump its stack)" == hang.describe(report)
    assert hang.parse_report({**report, "rank": "1"}) is None and hang.parse_hangs("{") == (0, None)
    saving = {**state(2, hang.COLLECTIVE), "stalled": False}  # a slow save's barrier: within its allowance
    assert hang.gang_hung(waiting) and not hang.gang_hung([*waiting, saving])
    assert hang.gang_hung([saving, {**state(1, hang.STOPPED), "stalled": False}])  # a stopped rank: no allowance


BLOCKED = '''
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, file=open(sys.argv[1], "w"), all_threads=True)
code = compile("def all_reduce():\\n    print('ready', flush=True)\\n    time.sleep(60)\\n", sys.argv[2], "exec")
exec(code, globals())
all_reduce()
'''


@pytest.mark.parametrize(("path", "state"), [
    ("/venv/lib/python3/site-packages/torch/distributed/distributed_c10d.py", hang.COLLECTIVE),
    ("/venv/lib/python3/site-packages/kubetron/data/loader.py", hang.ELSEWHERE)])
def test_a_stack_dump_says_where_the_main_thread_waits(tmp_path, path, state):
    """faulthandler's dump of a process blocked in C (a sleep standing in for a collective's recv)."""
    dump = tmp_path / "stacks.txt"
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED, str(dump), path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "all_reduce" not in (dump.read_text() if dump.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    text = dump.read_text()
    assert hang.classify(text) == state, text
    assert re.match(rf"{Path(path).name}:\d in all_reduce", hang.innermost(text)), text
    assert hang.classify("") == hang.UNRESPONSIVE


# -- the heartbeat --------------------------------------------------------------------------------------


def test_the_heartbeat_is_what_the_run_s_events_say_and_its_time_by_phase(tmp_path):
    """The heartbeat listens to the run's events (kubetron.events) and publishes what the watchdog reads."""
    path = tmp_path / "beat"
    b = Heartbeat(str(path))
    assert watchdog.read_beat(str(path)).phase == STARTUP
    events = Events([b])
    events.emit(Started(10, 20, 80, 0.0, None))
    events.emit(PhaseEntered(TRAIN))
    for it, seconds in ((11, 0.02), (12, 0.05)):
        events.emit(StepDone(it, seconds, 8 * it, {}, 1e-3, None, False, None, 1.0))
    with events.phase(CHECKPOINT):
        seen = watchdog.read_beat(str(path))
        assert seen.phase == CHECKPOINT and seen.iteration == 12 and seen.pid == os.getpid()
        time.sleep(0.03)
        before = seen.progress_at
        events.emit(PROGRESS)  # a file written
        assert watchdog.read_beat(str(path)).progress_at > before
    after = watchdog.read_beat(str(path))
    assert after.phase == TRAIN and after.steps == 2 and after.slowest_step == 0.05
    spent = b.trainer_time()
    assert spent["steps"] == 2 and spent["train"] == 0.07 and 0.03 <= spent["checkpoint"] < 1.0
    events.emit(Stopping(0, "training completed"))
    assert watchdog.read_beat(str(path)).phase == TEARDOWN
    assert Heartbeat().trainer_time()["steps"] == 0  # outside the launcher: nothing written, still counted


# -- the watchdog, with real processes --------------------------------------------------------------------


RANK = '''
import sys, time
from kubetron.supervisor import heartbeat
from kubetron.contract.hang import TRAIN
b = heartbeat.Heartbeat.from_env()
b.enter(TRAIN)
for it in range(1, 4):
    b.step_done(it, 0.001)
b.enter(sys.argv[1])
print("stalled", flush=True)
time.sleep(120)
'''


def rank_process(tmp_path: Path, local_rank: int, phase: str = TRAIN) -> subprocess.Popen:
    env = {**os.environ, heartbeat.HEARTBEAT_ENV: watchdog.heartbeat_path(str(tmp_path), local_rank),
           heartbeat.STACKS_ENV: watchdog.stacks_path(str(tmp_path), local_rank)}
    proc = subprocess.Popen([sys.executable, "-c", RANK, phase], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "stalled"
    return proc


@pytest.mark.hangs_on_purpose
def test_the_watchdog_names_a_stopped_rank_dumps_the_others_and_stops_them(tmp_path, capsys):
    """Rank 1 is stopped in a checkpoint save (whose allowance is 10 x the timeout, 10 s): a stopped process
    does no legitimately long work, so the gang is hung once both are idle past the 1 s timeout."""
    ranks = [rank_process(tmp_path, 0), rank_process(tmp_path, 1, CHECKPOINT)]
    os.kill(ranks[1].pid, signal.SIGSTOP)
    started = time.monotonic()
    store, folder = Store(), tmp_path / "store"
    dog = watchdog.Watchdog(str(tmp_path), node_rank=0, override=1.0, store_url=str(folder), attempt="3")
    dog.new_round([watchdog.Rank(r, r, p.pid) for r, p in enumerate(ranks)], store, nnodes=1, restart=0,
                  restarts_left=2)
    try:
        deadline, report = time.monotonic() + 30, None
        while report is None and time.monotonic() < deadline:
            report = dog.poll()
            time.sleep(0.05)
        assert report is not None and dog.settle() == report and time.monotonic() - started < 8
        assert (report["rank"], report["state"], report["ranks"], report["restart"]) == (1, hang.STOPPED, 2, 1)
        assert report["phase"] == CHECKPOINT and report["timeoutSeconds"] == 1.0
        assert report["idleSeconds"] > 1.0 and report["stacks"] == f"{folder}/hangs/3-1/"
        assert [p.wait(timeout=10) for p in ranks] == [-signal.SIGKILL] * 2  # the stopped one too
    finally:
        for p in ranks:
            p.kill()
    assert "time.sleep" not in (folder / "hangs/3-1/rank-1.txt").read_text()  # a stopped process cannot dump
    assert "<module>" in (folder / "hangs/3-1/rank-0.txt").read_text()
    assert json.loads((folder / "hangs/3-1/report.json").read_text()) == report
    log = capsys.readouterr().err
    assert "kubetron.watchdog: the gang hung (2 ranks without progress): rank 1 (pod rank 0) hung" in log
    assert log.index("rank 1: stopped") < log.index("rank 0: elsewhere")  # the hung one first


def two_pods_rank_1_stopped(tmp_path: Path, restarts_left: int):
    """Two pods of one rank each, pod 1's rank SIGSTOPped; their watchdogs on one round's store."""
    (tmp_path / "p0").mkdir()
    (tmp_path / "p1").mkdir()
    ranks = [rank_process(tmp_path / "p0", 0), rank_process(tmp_path / "p1", 0)]
    os.kill(ranks[1].pid, signal.SIGSTOP)
    store = Store()
    dogs = [watchdog.Watchdog(str(tmp_path / f"p{n}"), node_rank=n, override=1.0) for n in (0, 1)]
    for n, dog in enumerate(dogs):
        dog.new_round([watchdog.Rank(n, 0, ranks[n].pid)], store, nnodes=2, restart=0, restarts_left=restarts_left)
    return ranks, store, dogs


def judged_by(dogs, store: Store, waiting: int, acting: int) -> watchdog.HangReport:
    """Pod `waiting` publishes its stalled rank (no verdict yet), then pod `acting` agrees and stops its rank."""
    deadline = time.monotonic() + 30
    while f"{watchdog.KEY}{waiting}" not in store.data:
        assert dogs[waiting].poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    while (report := dogs[acting].poll()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return report


@pytest.mark.hangs_on_purpose
def test_a_pod_whose_gang_another_pods_agent_restarted_says_the_same_verdict(tmp_path, monkeypatch, capsys):
    """Pod 0's agent reaches the verdict first and restarts its ranks; pod 1's agent, whose rank is the stopped
    one, sees a new round begin before its own verdict (torchrun restarts its healthy workers): it reads the
    verdict from the round's store, says it as pod 0 does, and its next ranks count the hang."""
    monkeypatch.setenv(HANGS_ENV, "")  # set by the hook: restored after the test
    ranks, store, dogs = two_pods_rank_1_stopped(tmp_path, restarts_left=3)
    try:
        judged_by(dogs, store, waiting=1, acting=0)
        assert ranks[0].wait(timeout=10) == -signal.SIGKILL
        capsys.readouterr()
        torchrun.Recovery(dogs[1]).rejoined(1, 3)  # torchrun restarts pod 1's healthy workers
        log = capsys.readouterr().err
        assert re.search(r"kubetron.torchrun: the gang hung: rank 1 \(pod rank 1\) hung: .*restarting the gang in "
                         r"place from the newest checkpoint \(restart 1 of 3\)", log), log
        assert json.loads(os.environ[HANGS_ENV])["hangs"] == 1  # the next ranks report it

        capsys.readouterr()
        dogs[1].new_round([watchdog.Rank(1, 0, ranks[1].pid)], Store(), nnodes=2, restart=1, restarts_left=2)
        torchrun.Recovery(dogs[1]).rejoined(2, 3)  # a new round with no hang (a peer's own failure, say)
        assert "kubetron.torchrun: another pod's agent began a new round: restarting the gang in place from the " \
               "newest checkpoint (restart 2 of 3)" in capsys.readouterr().err
    finally:
        for p in ranks:
            p.kill()
            p.wait()


@pytest.mark.hangs_on_purpose
def test_a_pod_that_withdrew_its_part_still_learns_the_verdict_another_pod_acted_on(tmp_path, capsys):
    """Pod 1's agent (its rank the stopped one) judges first and stops its rank. Pod 0's rank, ending of its
    peer's death, moves again before pod 0's agent reads the verdict, so pod 0 withdraws its part: its agent
    still learns the verdict pod 1 acted on (and its pod ends Hung with no restart left, not PeerFailure)."""
    ranks, store, dogs = two_pods_rank_1_stopped(tmp_path, restarts_left=0)
    try:
        report = judged_by(dogs, store, waiting=0, acting=1)
        Heartbeat(watchdog.heartbeat_path(str(tmp_path / "p0"), 0))  # pod 0's rank moves again (it is ending)
        time.sleep(watchdog.POLL_SECONDS + 0.1)
        assert dogs[0].poll() is None and f"{watchdog.KEY}0" not in store.data  # withdrawn
        capsys.readouterr()
        assert dogs[0].settle() == report and report["rank"] == 1 and report["restart"] == 0
        assert "kubetron.watchdog: the gang hung (2 ranks without progress): rank 1 (pod rank 1) hung" in \
            capsys.readouterr().err
        store.set(watchdog.VERDICT_KEY, json.dumps(["[]", "{"]))  # garbled by anyone: no verdict drawn from it
        dogs[0].new_round([watchdog.Rank(0, 0, ranks[0].pid)], store, nnodes=2, restart=1, restarts_left=0)
        assert dogs[0].settle() is None
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_torchruns_restart_of_healthy_workers_reaches_the_hook():
    """The adaptation of torchrun's agent: a restart of a HEALTHY group (a peer pod began a new round) counts
    a restart, tells the hooks which, and SIGKILLs the survivors."""
    calls = []

    class Agent:
        _remaining_restarts = 3

        def _restart_workers(self, group):
            calls.append(("restart", self._remaining_restarts))

        def _shutdown(self, death_sig):
            calls.append(("shutdown", death_sig))

    class Hooks:
        def rejoined(self, restart, max_restarts):
            calls.append(("rejoined", restart, max_restarts))

    elastic._restart_kills_the_survivors(Agent, Hooks())
    group = SimpleNamespace(state=SimpleNamespace(name="HEALTHY"), spec=SimpleNamespace(max_restarts=3))
    Agent()._restart_workers(group)
    assert calls == [("rejoined", 1, 3), ("shutdown", signal.SIGKILL), ("restart", 2)]
    calls.clear()
    Agent()._restart_workers(SimpleNamespace(state=SimpleNamespace(name="FAILED"), spec=group.spec))
    assert calls == [("shutdown", signal.SIGKILL), ("restart", 3)]  # a failure: counted by torch, said by failed()


def test_a_pod_waits_for_every_pod_and_withdraws_when_a_rank_moves_again(tmp_path):
    rank = rank_process(tmp_path, 0)
    store = Store()
    dog = watchdog.Watchdog(str(tmp_path), node_rank=1, override=1.0)
    dog.new_round([watchdog.Rank(1, 0, rank.pid)], store, nnodes=2, restart=0, restarts_left=0)
    try:
        deadline = time.monotonic() + 30
        while f"{watchdog.KEY}1" not in store.data and time.monotonic() < deadline:
            assert dog.poll() is None  # pod 0 has not said its ranks are stalled: no verdict
            time.sleep(0.05)
        assert json.loads(store.data[f"{watchdog.KEY}1"])[0]["state"] == hang.ELSEWHERE  # in time.sleep
        Heartbeat(watchdog.heartbeat_path(str(tmp_path), 0))  # the rank beats again (a new record)
        time.sleep(watchdog.POLL_SECONDS + 0.1)
        assert dog.poll() is None and f"{watchdog.KEY}1" not in store.data and rank.poll() is None
    finally:
        rank.kill()
        rank.wait()


# -- two pods' launchers and torchrun ---------------------------------------------------------------------

ARGS = ["train", "--config", TINY, *QUICK, "train.train_iters=100", "scheduler.lr_warmup_iters=1",
        "checkpoint.save_interval=10"]
TIMEOUT = "8"  # KUBETRON_HANG_TIMEOUT_SECONDS (spec.hangTimeoutSeconds), short for the test
STOP_RANK_1 = fault_at(15, "STOP", rank=1)  # rank 1 SIGSTOPs itself once iteration 15 is done (its first life)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.hangs_on_purpose
def test_a_stopped_rank_is_named_its_stacks_stored_and_the_gang_restarted_in_place(tmp_path):
    store = tmp_path / "ckpt"
    pods = start_pods(tmp_path, [*ARGS, f"checkpoint.save={store}", f"checkpoint.load={store}"],
                      KUBETRON_HANG_TIMEOUT_SECONDS=TIMEOUT, **STOP_RANK_1)
    codes, outs, log = run_to_end(pods, timeout=300)
    assert codes == [0, 0], log[-6000:]
    # how long the watchdog saw no progress from rank 1 when it judged: past the timeout, by less than its polls
    idle = [int(s) for s in re.findall(r"the gang hung: rank 1 \(pod rank 1\) hung: no progress for (\d+) s", log)]
    assert len(idle) == 2 and all(int(TIMEOUT) <= s < int(TIMEOUT) + 10 for s in idle), idle  # each pod's agent
    for out in outs:  # each pod's agent: the same verdict, then the restart
        text = "".join(out)
        assert re.search(r"kubetron.torchrun: the gang hung: rank 1 \(pod rank 1\) hung: no progress for \d+ s "
                         rf"\(timeout {TIMEOUT} s\) in phase train after iteration \d+ \(stopped: it could not dump "
                         r"its stack\): restarting the gang in place from the newest checkpoint \(restart 1 of 3\)",
                         text), [line for line in out if "kubetron." in line and "[kubetron" not in line]
    (folder,) = (store / "hangs").iterdir()
    report = json.loads((folder / "report.json").read_text())
    assert (report["rank"], report["nodeRank"], report["state"], report["restart"]) == (1, 1, hang.STOPPED, 1)
    assert report["stacks"] == f"{store}/hangs/{folder.name}/"
    rank0 = (folder / "rank-0.txt").read_text()
    # waiting for rank 1 in the training loop: in a step's collectives, or a checkpoint save's when rank 1
    # was stopped just before an iteration that saves (where it stops depends on the machine's load)
    assert hang.classify(rank0) == hang.COLLECTIVE, rank0
    assert any("/kubetron/training/train.py" in frame for frame in hang.main_thread(rank0)), rank0
    assert "no stack" in (folder / "rank-1.txt").read_text()
    progress = (store / "progress.txt").read_text()
    assert f"Hang detected\tIteration: {report['iteration']}\tRank: 1\tPod rank: 1\tPhase: train" in progress
    assert "Restarted in place" in progress.split("Hang detected", 1)[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.hangs_on_purpose
def test_with_no_in_place_restart_left_the_pods_end_hung(tmp_path):
    store = tmp_path / "ckpt"
    pods = start_pods(tmp_path, [*ARGS, f"checkpoint.save={store}", f"checkpoint.load={store}"], max_restarts=0,
                      KUBETRON_HANG_TIMEOUT_SECONDS=TIMEOUT, **STOP_RANK_1)
    codes, outs, log = run_to_end(pods, timeout=120)
    assert codes == [exitcodes.HUNG] * 2, "".join(outs[0])[-3000:] + "\n--- pod 1 ---\n" + "".join(outs[1])[-3000:]
    for rank in (0, 1):
        message = json.loads((tmp_path / f"pod{rank}" / "termination-log").read_text())
        assert message["reason"] == "Hung" and message["hang"]["rank"] == 1 and message["hang"]["restart"] == 0
        assert message["message"].startswith("the gang hung: rank 1 (pod rank 1) hung: ")
        assert outs[rank][-1].startswith("kubetron.launch: the gang hung: rank 1"), outs[rank][-3:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_slow_checkpoint_store_is_not_a_hang(tmp_path, s3_server):
    """Every write to the store answered 2 s late: saves take many times the hang timeout (4 s), blocking the
    loop (the final one, and each save that waits for the one before), yet progress (a file written) keeps
    the ranks alive: no hang, the run completes."""
    store = f"s3://{s3_server.bucket}/slow-{os.getpid()}-{time.monotonic_ns()}"
    writes = lambda method, path: method in ("PUT", "POST")  # noqa: E731
    with FaultProxy(s3_server.endpoint, p_delay=1.0, delay_s=2.0, match=writes) as px:
        pods = start_pods(tmp_path, [*ARGS, "train.train_iters=20", f"checkpoint.save={store}",
                                     f"checkpoint.load={store}"], KUBETRON_HANG_TIMEOUT_SECONDS="4",
                          **s3_server.env(px.endpoint))
        codes, outs, log = run_to_end(pods, timeout=600)
        assert px.stats["delay"] > 10
    assert codes == [0, 0], log[-6000:]
    assert "hung" not in log and "kubetron.watchdog" not in log
    saves = [float(s) for s in re.findall(r"saved checkpoint iter_\d+ at iteration \d+ \(([0-9.]+)s\)", log)]
    assert saves and max(saves) > 4 * 2, saves  # a save far slower than the hang timeout
