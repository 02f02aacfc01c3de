"""bench/recovery.py --quick, as a user runs it (so it never rots): on the real control plane a 2-pod job's
rank is SIGKILLed once with in-place restarts and once with whole-gang recreation (its pods on two Nodes with
room for nothing else: the restart needs no room for another pod), and SIGSTOPped once (a hang, found by the
pods' watchdogs, spec.hangTimeoutSeconds 10); all resume from the newest checkpoint, and every phase of each
timeline is measured and adds up to the recovery time. An elastic job (nodes 2, minNodes 1) has one of its two
Nodes drained, then uncordoned: it trains at 1 node, then at 2 again.
(`--imports 0`: the import comparison is left out here; tests/test_startup.py checks what it measures.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kubetron.supervisor import startup

from tests.kube.cluster import NoBinaries, find_binaries

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]
BENCH = Path(__file__).resolve().parents[2] / "bench" / "recovery.py"
SAVE_INTERVAL = 4  # the bench's default
DETECTED, STOPPED = "hang detected (no progress past the timeout)", "pods agree, gang stopped, restart"


@pytest.mark.hangs_on_purpose
def test_recovery_bench_quick(tmp_path):
    try:
        find_binaries()
    except NoBinaries as exc:
        pytest.skip(str(exc))
    out = tmp_path / "recovery.json"
    p = subprocess.run([sys.executable, str(BENCH), "--quick", "--imports", "0", "--json", str(out),
                        "--logs", str(tmp_path)],
                       capture_output=True, text=True, timeout=840)
    logs = "\n".join(f.read_text()[-3000:] for f in sorted(tmp_path.glob("*.log")))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[:3000] + "\n...\n" + p.stderr[-3000:] + logs
    print(p.stdout)
    report = json.loads(out.read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    assert sorted(runs) == ["hang", "in place", "recreate"]

    for mode, run in runs.items():
        # resumed from the newest state: a memory snapshot (in place, when one newer than the store's exists) or
        # the newest durable checkpoint (a save in flight at the kill may have become it)
        resumed = run["first_iteration"] - 1
        assert resumed == run["resumed_from"], run
        assert run["loaded_from"] in (("memory", "store") if mode != "recreate" else ("store",)), run
        assert run["checkpoint_at_kill"] > 0 and run["checkpoint_at_kill"] <= resumed <= run["killed_at_iteration"], run
        if run["loaded_from"] == "store":
            assert resumed % SAVE_INTERVAL == 0, run
        # every phase of the mode measured, in order, none negative; together the whole recovery time
        phases = run["phases"]
        pods = ["operator deletes the gang", "old pods gone", "failure backoff (status.nextAttemptTime)",
                "new pods created + bound"]
        detect = [DETECTED, STOPPED] if mode == "hang" else ["detect"]
        expected = [*detect, *(pods if mode == "recreate" else []), "to trainer process start", *startup.PHASES]
        assert list(phases) == expected, (mode, phases)
        assert all(v >= 0 for v in phases.values()), (mode, phases)
        assert sum(phases.values()) == pytest.approx(run["total"], abs=0.01 * len(phases) + 0.02), (mode, phases)

    # The hang: found after the timeout (10 s) and a poll or two, training again well within the goal (120 s).
    assert 10 < runs["hang"]["phases"][DETECTED] < 30 and runs["hang"]["total"] < 120, runs["hang"]
    # Recreated at once (no pod read the progress log): the operator's deletion and creation take seconds.
    recreate = runs["recreate"]["phases"]
    assert recreate["old pods gone"] + recreate["new pods created + bound"] < 30, recreate
    assert report["ratio"] == pytest.approx(runs["in place"]["total"] / runs["recreate"]["total"])
    assert report["ratio"] < 1, report  # no pods to replace, no second torch import in a new agent
    assert f"in place / recreate: {report['ratio']:.2f}" in p.stdout
    elastic = report["elastic"]
    assert list(elastic) == ["capacity gone -> training at 1 of 2 nodes", "capacity back -> training at 2 nodes"]
    assert all(0 < seconds < 600 for seconds in elastic.values()), elastic
