"""In-place recovery (docs/recovery.md), as two pods' entry points see it: two `python -m kubetron.launch`
processes on localhost (NNODES=2, NODE_RANK=0/1, one rank each, real torchrun with gloo) training the
tiny GPT into one store.

- A trainer process SIGKILLed mid-run is restarted inside the same "pods" (the launchers never exit):
  every rank resumes from the newest checkpoint, recomputes the lost iterations to the same losses,
  and the job completes with exit 0. Rank 0 records the restart in the progress log.
- An end no restart can cure (a config error, exit 2) is not restarted: the pod exits 2 at once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from kubetron.contract import exitcodes
from kubetron.contract import progress as progress_log
from kubetron.supervisor import launch

from tests.multirank.launchers import collect, finish, run_to_end, start_pods, trainer_pid
from tests.trainer_utils import LOSS_RE, QUICK, TINY, iteration_at_least

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parent.parent

def losses(lines: list[str]) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in map(LOSS_RE.search, list(lines)) if m]


def repeated(seen: list[tuple[int, str]]) -> list[int]:
    """Where the logged iterations go back (a resume): the indexes into `seen` of each first step again."""
    return [i for i, (it, _) in enumerate(seen) if i and it <= seen[i - 1][0]]


@pytest.mark.slow
@pytest.mark.parametrize("nodes, nproc", [(2, 1), (1, 2)], ids=["2 pods x 1 rank", "1 pod x 2 ranks"])
def test_a_killed_trainer_is_restarted_in_place_from_the_newest_checkpoint(tmp_path, nodes, nproc):
    store = tmp_path / "ckpt"
    pods = start_pods(tmp_path, ["train", "--config", TINY, *QUICK, "train.train_iters=100",
                                 "scheduler.lr_warmup_iters=1", "checkpoint.save_interval=10",
                                 f"checkpoint.save={store}", f"checkpoint.load={store}"],  # as the operator sets them
                      nodes=nodes, nproc=nproc)
    launchers = [p.pid for p in pods]
    outs: list[list[str]] = [[] for _ in pods]
    out_last = outs[-1]  # the last rank logs the iterations
    # the last pod's reader holds at iteration 15: its rank cannot get more than a page of output further (below
    # iteration 30 of 100) before the kill, however late this test runs (CI once read it at 100, run over)
    readers = [collect(pod, out, hold_at=iteration_at_least(15) if pod is pods[-1] else None)
               for pod, out in zip(pods, outs, strict=True)]
    with readers[-1].held(300, explain=lambda: "".join(sum(outs, []))[-4000:]):
        killed = trainer_pid(pods, 0)  # rank 0: it writes the progress log; its pod's agent hosts the rendezvous
        os.kill(killed, signal.SIGKILL)
        killed_at = time.monotonic()
    while not repeated(losses(out_last)):  # the first step after the restart: an iteration logged again
        assert time.monotonic() - killed_at < 120 and all(p.poll() is None for p in pods), "".join(
            sum(outs, []))[-4000:]
        time.sleep(0.05)
    print(f"recovery: {time.monotonic() - killed_at:.1f} s from the kill to the first step after the restart")

    codes = finish(pods, timeout=120)
    for r in readers:
        r.join(timeout=10)
    log = "\n----- next pod -----\n".join("".join(out) for out in outs)
    assert codes == [0] * nodes, log[-6000:]
    assert [p.pid for p in pods] == launchers  # the same "pods": no launcher was replaced
    restarted = f"rank 0 (local rank 0, pid {killed}) was killed by SIGKILL: restarting the gang in place"
    assert restarted in log, log[-6000:]

    # Resumed from the newest checkpoint before the kill: the iterations after it ran twice, to the same losses
    # (the last rank logs them).
    seen = losses(out_last)
    again = repeated(seen)
    assert len(again) == 1, seen
    resumed_at = seen[again[0]][0]
    assert resumed_at % 10 == 1 and resumed_at > 10, seen
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
    Pod 1 ends too (2, or 1 when the rendezvous host in pod 0 went away before its rank's end was seen)."""
    pods = start_pods(tmp_path, ["train", "--config", TINY, *QUICK, "train.train_iters=-3"])
    codes, outs, log = run_to_end(pods, timeout=120)
    assert codes[0] == exitcodes.CONFIG_ERROR and codes[1] in (exitcodes.CONFIG_ERROR, exitcodes.ERROR), log[-4000:]
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
