"""The chaos soak's CI run (bench/chaos.py, its own code): ten seeded faults of ten kinds on a 2-pod job of the tiny
GPT, on a control plane of its own (it restarts the API server), with the real operator, trainers and S3 server, the
store behind a fault proxy. Ranks SIGKILLed (restarted in place), SIGTERMed (saved, preempted), an agent killed (a
failure), an agent stopped for a while, pods evicted and deleted, the operator SIGKILLed, the API server restarted,
the store away and slow, each at a moment the seed picks (mid-step, mid-save, mid-restart, mid-rendezvous, during
the operator's start). The job must succeed with every loss bit-identical to the same job's run without faults, its
status counting exactly the restarts the faults cause, goodput's buckets adding up, no operator crash, no process,
pod or Service of it left and no Event flood: the checks the certificate prints, every one of which must hold.
"""

from __future__ import annotations

import time

import pytest

from tests.kube.cluster import NoBinaries, find_binaries
from tests.trainer_utils import bench_module

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]
SEED = 45
GAP = 8  # iterations between two faults' earliest moments (the soak's 15 by default): a checkpoint between two
KINDS = ["rank-kill", "rank-term", "agent-kill", "agent-stop", "pod-evict", "pod-delete", "operator-kill",
         "apiserver-restart", "store-down", "store-slow"]


def test_ten_seeded_faults_end_bit_exact_with_nothing_left(tmp_path):
    try:
        find_binaries()
    except NoBinaries as exc:
        pytest.skip(str(exc))
    chaos = bench_module("chaos")

    def log(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)
    result = chaos.soak(tmp_path, faults=len(KINDS), seed=SEED, kinds=KINDS, log=log, gap=GAP)
    text = chaos.certificate(result)
    print("\n" + text)
    assert result.ok, text
    assert sorted(f.kind for f in result.faults) == sorted(KINDS), text  # each kind once: the least used is drawn
    assert all(f.recovered is not None for f in result.faults), text  # the job trained again after every fault
