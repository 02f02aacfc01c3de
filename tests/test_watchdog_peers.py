"""What a peer's key in the job's rendezvous store can make a pod's hang watchdog do (docs/security.md,
"The rendezvous store"). torch's c10d store has no authentication: a key there may come from a peer or from
anyone who reaches the master port. The watchdog reads its peers' `kubetron/hang/<n>` keys bounded and checked
(contract.hang.parse_states); what it can still be made to do is restart its own gang in place, and only while
its own ranks are idle past the iteration's timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubetron.contract import hang
from kubetron.contract.hang import CHECKPOINT, STATE_BYTES, TRAIN, parse_states
from kubetron.supervisor import heartbeat, watchdog

from tests.rendezvous_store import Store

pytestmark = pytest.mark.unit


def state(**kw):
    return {"rank": 0, "nodeRank": 0, "localRank": 0, "phase": TRAIN, "iteration": 30, "idleSeconds": 50.0,
            "timeoutSeconds": 45.0, "stalled": True, "state": hang.STOPPED, "where": "", **kw}


KEYS = [
    ("a peer's state", [json.dumps([state()])], True),
    ("not JSON", [b"\xff{"], False),
    ("not a list", [json.dumps(state())], False),
    ("no rank at all", [json.dumps([])], False),
    ("another pod's rank", [json.dumps([state(nodeRank=1)])], False),
    ("a phase nobody has", [json.dumps([state(phase="x" * 100)])], False),
    ("a state nobody has", [json.dumps([state(state="rm -rf")])], False),
    ("a negative rank", [json.dumps([state(rank=-1)])], False),
    ("a bool for a number", [json.dumps([state(iteration=True)])], False),
    ("a string for a flag", [json.dumps([state(stalled="yes")])], False),
    ("infinite idleness", ['[{"rank": 0, "nodeRank": 0, "localRank": 0, "phase": "train", "iteration": 3, '
                           '"idleSeconds": Infinity, "timeoutSeconds": 1, "stalled": true, "state": "stopped", '
                           '"where": ""}]'], False),
    ("more than 64 KiB", [json.dumps([state(where="w" * STATE_BYTES)])], False),
    ("more ranks than a node has", [json.dumps([state()] * 1025)], False),
]


@pytest.mark.parametrize(("case", "values", "taken"), KEYS, ids=[k[0] for k in KEYS])
def test_a_peers_key_is_read_only_when_it_is_a_state_of_that_peer(case, values, taken):
    ranks = parse_states(values, 1)
    assert (ranks is not None) == taken
    if taken:
        assert ranks[0]["state"] == hang.STOPPED


def test_a_peers_strings_are_cut_short():
    (rank,) = parse_states([json.dumps([state(where="w" * 60_000)])], 1)
    assert len(rank["where"]) == hang.WHERE_CHARS


SAVING = '''
import time
from kubetron.supervisor import heartbeat
from kubetron.contract.hang import CHECKPOINT, TRAIN
b = heartbeat.Heartbeat.from_env()
b.enter(TRAIN)
for it in range(1, 4):
    b.step_done(it, 0.001)
b.enter(CHECKPOINT)
print("saving", flush=True)
time.sleep(120)
'''


@pytest.mark.process
@pytest.mark.hangs_on_purpose
def test_a_forged_peer_key_makes_no_verdict_and_a_well_formed_one_only_restarts_an_idle_gang(tmp_path: Path):
    """Pod 1's rank saves a checkpoint (its allowance: 10 x the 1 s timeout). A garbled key of pod 0 draws no
    verdict (the rank runs on); a well-formed one claiming pod 0's rank stopped makes the watchdog restart its
    gang once its own rank is idle past the iteration's timeout: the most a peer's key can do."""
    env = {**os.environ, heartbeat.HEARTBEAT_ENV: watchdog.heartbeat_path(str(tmp_path), 0),
           heartbeat.STACKS_ENV: watchdog.stacks_path(str(tmp_path), 0)}
    rank = subprocess.Popen([sys.executable, "-c", SAVING], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "saving"
        store = Store()
        dog = watchdog.Watchdog(str(tmp_path), node_rank=1, override=1.0)
        dog.new_round([watchdog.Rank(1, 0, rank.pid)], store, nnodes=2, restart=0, restarts_left=1)
        store.set(f"{watchdog.KEY}0", json.dumps([state(where="w" * 10_000, nodeRank=7)]))  # not pod 0's rank
        deadline = time.monotonic() + 30
        while f"{watchdog.KEY}1" not in store.data and time.monotonic() < deadline:
            assert dog.poll() is None
            time.sleep(0.05)
        for _ in range(2):  # published, polled again: still no verdict from a key that is not a state
            time.sleep(watchdog.POLL_SECONDS)
            assert dog.poll() is None and rank.poll() is None
        mine = json.loads(store.data[f"{watchdog.KEY}1"])
        assert mine[0]["phase"] == CHECKPOINT and not mine[0]["stalled"]  # within its allowance
        store.set(f"{watchdog.KEY}0", json.dumps([state(where="w" * 10_000)]))
        report = None
        while report is None and time.monotonic() < deadline:
            report = dog.poll()
            time.sleep(0.05)
        assert report is not None and report["rank"] == 0 and len(report["where"]) == hang.WHERE_CHARS
        assert rank.wait(timeout=10) == -signal.SIGKILL
    finally:
        rank.kill()
        rank.wait()
