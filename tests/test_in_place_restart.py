"""In-place recovery (docs/recovery.md), as two pods' entry points see it: two `python -m kubetron.launch`
processes on localhost (NNODES=2, NODE_RANK=0/1, one rank each, real torchrun with gloo) training the
tiny GPT into one store.

- A trainer process SIGKILLed mid-run is restarted inside the same "pods" (the launchers never exit):
  every rank resumes from the newest checkpoint, recomputes the lost iterations to the same losses,
  and the job completes with exit 0. Rank 0 records the restart in the progress log.
- An end no restart can cure (a config error, exit 2) is not restarted: the pod exits 2 at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

import psutil
import pytest
from kubetron.contract import exitcodes
from kubetron.contract import progress as progress_log
from kubetron.contract.recovery import REPLICATION_FACTOR_ENV
from kubetron.supervisor import launch

from tests.multirank.launchers import collect, finish, kill_pod, run_to_end, start_pod, start_pods
from tests.multirank.runner import fault_at, free_port
from tests.trainer_utils import LOSS_RE, QUICK, TINY, stopped_trainer

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parent.parent
KILLED_AT = 18  # rank 0 SIGKILLs itself once this iteration is done (KUBETRON_CHAOS_KILL_AT, its first life only)

def losses(lines: list[str]) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in map(LOSS_RE.search, list(lines)) if m]


def repeated(seen: list[tuple[int, str]]) -> list[int]:
    """Where the logged iterations go back (a resume): the indexes into `seen` of each first step again."""
    return [i for i, (it, _) in enumerate(seen) if i and it <= seen[i - 1][0]]


@pytest.mark.slow
@pytest.mark.parametrize("nodes, nproc, memory", [(2, 1, True), (1, 2, False)],
                         ids=["2 pods x 1 rank, snapshots in memory", "1 pod x 2 ranks, the store"])
def test_a_killed_trainer_is_restarted_in_place_from_the_newest_checkpoint(tmp_path, nodes, nproc, memory):
    """With a memory volume per pod (docs/recovery.md) the gang resumes from the newest snapshot there (every
    3 iterations), newer than the store's (every 10); without, from the store. The pods keep their snapshots to
    themselves (replication factor 1): a restart in place needs no copy, and copies pace the snapshots (a loaded
    machine's slow copies would leave none between the store's 10 and the kill)."""
    store = tmp_path / "ckpt"
    snapshots = ["checkpoint.non_persistent_save_interval=3"] if memory else []
    pods = start_pods(tmp_path, ["train", "--config", TINY, *QUICK, "train.train_iters=100",
                                 "scheduler.lr_warmup_iters=1", "checkpoint.save_interval=10", *snapshots,
                                 f"checkpoint.save={store}", f"checkpoint.load={store}"],  # as the operator sets them
                      nodes=nodes, nproc=nproc, memory=memory, **{REPLICATION_FACTOR_ENV: "1"},
                      **fault_at(KILLED_AT, "KILL", rank=0))
    launchers = [p.pid for p in pods]
    outs: list[list[str]] = [[] for _ in pods]
    out_last = outs[-1]  # the last rank logs the iterations
    readers = [collect(pod, out) for pod, out in zip(pods, outs, strict=True)]
    codes = finish(pods, timeout=300)
    for r in readers:
        r.join(timeout=10)
    log = "\n----- next pod -----\n".join("".join(out) for out in outs)
    assert codes == [0] * nodes, log[-6000:]
    assert [p.pid for p in pods] == launchers  # the same "pods": no launcher was replaced
    # rank 0 (it writes the progress log; its pod's agent hosts the rendezvous) SIGKILLed itself after iteration 18
    assert re.search(r"rank 0 \(local rank 0, pid \d+\) was killed by SIGKILL: restarting the gang in place", log), \
        log[-6000:]

    # Resumed from the newest checkpoint before the kill: the iterations after it ran twice, to the same losses
    # (the last rank logs them).
    seen = losses(out_last)
    again = repeated(seen)
    assert len(again) == 1, seen
    resumed_at = seen[again[0]][0]
    if memory:  # a snapshot (every 3), no older than the store's newest checkpoint (every 10; the kill at 18)
        assert (resumed_at - 1) % 3 == 0 and 10 < resumed_at <= KILLED_AT, seen
        assert f"resumed from the memory snapshot at iteration {resumed_at - 1} (every rank from its own pod" in log
    else:
        assert resumed_at == 11, seen
    first, second = dict(seen[:again[0]]), dict(seen[again[0]:])
    assert {it: first[it] for it in second if it in first} == {it: second[it] for it in second if it in first}, seen
    assert max(second) == 100

    events = progress_log.parse_progress((store / "progress.txt").read_text())
    restarts = [e for e in events if e.event == progress_log.RESTARTED_IN_PLACE]
    assert [e.fields.get(progress_log.IN_PLACE_RESTARTS_KEY) for e in restarts] == ["1"], events
    assert events[-1].event == progress_log.EXITING_JOB


@pytest.mark.slow
def test_a_config_error_is_not_restarted_in_place(tmp_path):
    """Exit 2 is final: pod 0 exits 2 at once (its rank's own one line last), nothing is restarted.
    Pod 1 ends too: 2, or, when the rendezvous host in pod 0 went away before its rank's end was seen, 5 (a peer
    failure: no rank of pod 1 ran yet) or 1 (its rank ran but had not said why)."""
    pods = start_pods(tmp_path, ["train", "--config", TINY, *QUICK, "train.train_iters=-3"])
    codes, outs, log = run_to_end(pods, timeout=120)
    assert codes[0] == exitcodes.CONFIG_ERROR and codes[1] in (
        exitcodes.CONFIG_ERROR, exitcodes.PEER_FAILURE, exitcodes.ERROR), log[-4000:]
    assert "restarting the gang in place" not in log, log[-4000:]
    assert outs[0][-1].startswith("kubetron: error: train.train_iters"), log[-4000:]


ENDS_FOR_GOOD = """
import datetime, sys
import torch.distributed as dist
from kubetron.supervisor.termination_log import write_termination_message

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
if dist.get_rank() == 1:  # a rank-specific end no restart cures
    write_termination_message({"exitCode": 3, "reason": "Diverged", "message": "loss is NaN at iteration 7"})
    sys.exit(3)
try:
    dist.barrier()  # its peer is gone
except RuntimeError:
    write_termination_message({"exitCode": 5, "reason": "PeerFailure", "message": "a peer rank failed"})
    sys.exit(5)
"""


@pytest.mark.slow
def test_a_rank_that_ends_for_good_ends_the_other_pods_too(tmp_path):
    """Pod 1's rank exits 3: pod 1 exits 3, unrestarted, and its agent closes the rendezvous. Pod 0's rank
    saw a peer failure (restartable), so its agent starts a restart, whose round cannot form: pod 0 ends
    at once with its rank's code (5), its log ending in one line, not torchrun's traceback."""
    (tmp_path / "ends_for_good.py").write_text(ENDS_FOR_GOOD)  # what the ranks run instead of the trainer
    pods = start_pods(tmp_path, [], **{"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                                       launch.TRAINER_MODULE_ENV: "ends_for_good"})
    codes, outs, log = run_to_end(pods, timeout=120)
    assert codes == [exitcodes.PEER_FAILURE, exitcodes.DIVERGED], log[-4000:]
    assert "Traceback" not in log and "restarting the gang in place" not in "".join(outs[1]), log[-4000:]
    assert outs[0][-1].startswith("kubetron.torchrun: not restarting: no new rendezvous round"), log[-4000:]


SAVES_ON_SIGTERM = """
import json, os, signal, sys, time
from pathlib import Path

def saved(*_):  # what the trainer does on SIGTERM: save, say so in its termination message, exit 75
    Path(os.environ["KUBETRON_TERMINATION_LOG"]).write_text(json.dumps(
        {"exitCode": 75, "reason": "SavedOnSignal", "message": "stopped by signal; checkpoint saved", "iteration": 7}))
    sys.exit(75)

signal.signal(signal.SIGTERM, saved)
Path(os.environ["READY_DIR"], os.environ["RANK"]).touch()
while True:
    time.sleep(0.1)
"""


@pytest.mark.slow
def test_a_pod_whose_agent_lost_the_rendezvous_host_reports_a_peer_failure_not_a_preemption(tmp_path):
    """Pod 0's torchrun agent (the rendezvous host) is SIGKILLed while the ranks train. Pod 1's agent loses the
    rendezvous and torch's agent SIGTERMs its rank on its way out; the rank saves (exit 75). Nothing sent pod 1 a
    signal: it ends with PeerFailure and a message saying so, not SavedOnSignal (which the operator would count
    as a free preemption: a crash-looping agent would never fail the job)."""
    (tmp_path / "saves_on_sigterm.py").write_text(SAVES_ON_SIGTERM)
    ready = tmp_path / "ready"
    ready.mkdir()
    pods = start_pods(tmp_path, [], **{"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                                       launch.TRAINER_MODULE_ENV: "saves_on_sigterm", "READY_DIR": str(ready)})
    orphans = []
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in pods), [p.poll() for p in pods]
            time.sleep(0.1)
        children = psutil.Process(pods[0].pid).children(recursive=True)
        agent = next(c for c in children if "kubetron.supervisor.torchrun" in " ".join(c.cmdline()))
        orphans = [c for c in children if c.pid != agent.pid]
        agent.kill()
        codes, outs, log = run_to_end(pods, timeout=120)
    finally:
        for c in orphans:  # pod 0's rank, orphaned: a container runtime ends it with its pod
            with contextlib.suppress(psutil.Error):
                c.kill()
    assert codes == [128 + 9, exitcodes.PEER_FAILURE], log[-4000:]
    last = json.loads((tmp_path / "pod1" / "termination-log").read_text())
    assert last["exitCode"] == exitcodes.PEER_FAILURE and last["iteration"] == 7, last
    assert "lost the gang's rendezvous while its ranks trained" in last["message"] and "saved at iteration 7" in \
        last["message"], last
    assert outs[1][-1].startswith("kubetron.launch: this pod's agent lost the gang's rendezvous"), log[-4000:]


@pytest.mark.slow
def test_a_pod_whose_rendezvous_host_went_away_before_its_ranks_ran_reports_a_peer_failure(tmp_path):
    """Pod 0 (the rendezvous host) is lost, every process of it, while pod 1's agent waits in a round (a third pod
    never comes: the round cannot form). Pod 1's agent loses the store; no rank of it ran to say why. It ends with
    PeerFailure and a message saying so, not TrainerError (exit 1): the operator then waits for pod 0's own end (its
    node lost) instead of counting a failure (the chaos soak's node-lost faults mid-rendezvous)."""
    port = str(free_port())
    args = ["train", "--config", TINY]
    pods = [start_pod(tmp_path / f"pod{rank}", args, rank, port, nodes=3) for rank in (0, 1)]
    try:
        def waiting_in_a_round() -> bool:  # pod 1's agent holds a connection to the rendezvous store
            agents = [c for c in psutil.Process(pods[1].pid).children(recursive=True)
                      if "kubetron.supervisor.torchrun" in " ".join(c.cmdline())]
            return any(c.raddr and c.raddr.port == int(port) and c.status == psutil.CONN_ESTABLISHED
                       for a in agents for c in a.net_connections("tcp"))

        deadline = time.monotonic() + 120
        while not waiting_in_a_round():
            assert time.monotonic() < deadline and all(p.poll() is None for p in pods), [p.poll() for p in pods]
            time.sleep(0.1)
        kill_pod(pods[0])
        codes, outs, log = run_to_end(pods, timeout=120)
    finally:
        for p in pods:
            if p.poll() is None:
                kill_pod(p)
    assert codes == [-9, exitcodes.PEER_FAILURE], log[-4000:]
    last = json.loads((tmp_path / "pod1" / "termination-log").read_text())
    assert last["exitCode"] == exitcodes.PEER_FAILURE and "could not form the gang's rendezvous round" in \
        last["message"], last
    assert outs[1][-1].startswith("kubetron.launch: this pod's agent could not form"), log[-4000:]


# -- which ends are restarted in place (no processes) ------------------------------------------------------

@pytest.mark.parametrize("ends, expected", [
    ([-9], True),  # SIGKILL (the OOM killer, a test)
    ([-11], True),  # a segfault
    ([exitcodes.PEER_FAILURE], True),
    ([exitcodes.STRAGGLER], True),
    ([137], True),  # not a code of the contract's
    ([-9, -15], True),  # torchrun SIGTERMed the sibling of the rank that died
    ([-15], False),  # only SIGTERMs: nothing to cure
    ([exitcodes.ERROR], False),
    ([exitcodes.CONFIG_ERROR, -15], False),
    ([exitcodes.DIVERGED], False),
    ([exitcodes.RESUME_MISMATCH], False),
    ([exitcodes.SAVED_ON_SIGNAL], False),
    ([exitcodes.EXIT_CONDITION], False),
    ([-9, exitcodes.CONFIG_ERROR], False),  # any end a restart cannot cure stops the restarts
])
def test_which_ends_are_restarted_in_place(ends, expected):
    from kubetron.supervisor import torchrun
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
                for rank, code in enumerate(ends)}
    assert torchrun.restartable(failures) is expected


@pytest.mark.slow
def test_a_lost_pods_replacement_resumes_from_its_peers_copy(tmp_path):
    """Two pods with memory volumes: pod 1 is lost whole (every process SIGKILLed, its volume gone) after its
    agent sent its newest snapshot to pod 0's. A new pod 1 joins pod 0's next rendezvous round; the gang
    resumes from that snapshot, rank 1's from pod 0's copy (docs/recovery.md), to the same losses."""
    from kubetron.storage import snapshot_files as sf

    store = tmp_path / "ckpt"
    args = ["train", "--config", TINY, *QUICK, "train.train_iters=100", "scheduler.lr_warmup_iters=1",
            "checkpoint.save_interval=50", "checkpoint.non_persistent_save_interval=3",
            f"checkpoint.save={store}", f"checkpoint.load={store}"]
    # rank 1 stops itself at 17, before it prints 17 (the gang waits on it: the run cannot end). Its newest
    # snapshot is then at most 15, so the new pod resumes at an iteration it had printed before the loss
    pods = start_pods(tmp_path, args, memory=True, **fault_at(17, "STOP", rank=1))
    port = _env_of(pods[0])["MASTER_PORT"]
    outs: list[list[str]] = [[], []]
    readers = [collect(pod, out) for pod, out in zip(pods, outs, strict=True)]
    copies = sf.peer_dir(tmp_path / "pod0" / "memory", 1)
    stopped_trainer(pods[1], 120, lambda: "".join(sum(outs, []))[-4000:])
    deadline = time.monotonic() + 120
    while not sf.iterations(copies):  # and pod 0 holds a copy of pod 1's snapshot
        assert time.monotonic() < deadline and all(p.poll() is None for p in pods), "".join(sum(outs, []))[-4000:]
        time.sleep(0.05)
    held = sf.iterations(copies)[-1]
    kill_pod(pods[1])
    readers[1].join(timeout=10)
    lost = tmp_path / "pod1"
    lost.rename(tmp_path / "lost-pod1")  # its memory volume goes with it
    pods[1] = start_pod(lost, args, 1, port, memory=True)
    new_out: list[str] = []
    readers.append(collect(pods[1], new_out))
    codes = finish(pods, timeout=300)
    for r in readers:
        r.join(timeout=10)
    log = "".join(outs[0]) + "\n----- new pod 1 -----\n" + "".join(new_out)
    assert codes == [0, 0], log[-6000:]
    assert "from copies on other pods" in log and "ranks 1 from copies" in log, log[-6000:]
    before, after = dict(losses(outs[1])), dict(losses(new_out))
    resumed_at = min(after)
    # a snapshot (every 3, the store has nothing before 50), no older than the copy pod 0 held at the kill
    assert resumed_at - 1 >= held and (resumed_at - 1) % 3 == 0 and max(after) == 100, sorted(after)
    assert {it: after[it] for it in before if it in after} == {it: before[it] for it in before if it in after}
    assert set(before) & set(after), (sorted(before), sorted(after))  # some iterations ran on both sides of the loss


def _env_of(pod) -> dict:
    import psutil

    return psutil.Process(pod.pid).environ()
