"""The elastic node range (spec.minNodes, docs/elastic.md) without a cluster: admission finds the sizes the
config works at, decide() shrinks a gang the scheduler cannot place, keeps probe pods while shrunk and grows
back once they are all bound, and build() sizes each attempt (env, PodGroup, Kueue group) and its probes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from kubetron.contract.resource import LABEL_ROLE
from kubetron_operator.build import build, build_probe_pod
from kubetron_operator.decide import decide
from kubetron_operator.model import KUEUE_COUNT_ANNOTATION, KUEUE_GROUP_LABEL, Job, SpecError
from kubetron_operator.observe import Observed, PodView
from kubetron_operator.policy.wake import next_due

from tests.operator.jobs import S3_JOB, job_body

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
RESTARTS = {"preemptions": 0, "failures": 0, "neverStarted": 0, "total": 0, "inPlace": 0, "hangs": 0}


def elastic(nodes=2, min_nodes=1, config=None, **spec):
    body = job_body(S3_JOB, nodes=nodes, minNodes=min_nodes, shrinkAfterSeconds=30, **spec)
    if config is not None:
        body["spec"]["config"] = yaml.safe_dump(config)
    return Job.from_body(body)


def batch_config(gbs, mbs=1, **model):
    return {"train": {"train_iters": 40, "global_batch_size": gbs, "micro_batch_size": mbs}, "model": model}


def pod(rank, attempt=1, phase="Running", role="worker", **kw):
    kw.setdefault("started", phase != "Pending")
    name = f"gpt-{attempt}-{rank}" if role == "worker" else f"gpt-{attempt}-probe-{rank}"
    return PodView(name=name, attempt=attempt, rank=rank, phase=phase, role=role, **kw)


def unplaced(rank, attempt=1):
    return pod(rank, attempt, phase="Pending", unschedulable="0/1 nodes are available: 1 Insufficient cpu.")


def starting(attempt=1, nodes=2, age=31.0, **extra):
    return {"phase": "Pending", "reason": "Unschedulable", "attempt": attempt, "nodes": nodes,
            "attemptStartTime": (NOW - timedelta(seconds=age)).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "startTime": "2026-11-22T11:00:00Z", "attemptStartCheckpoint": 0, "restarts": dict(RESTARTS), **extra}


def run(job, status, pods=()):
    return decide(job, Observed(now=NOW, status=status, pods=tuple(pods)))


# -- admission ------------------------------------------------------------------------------------------


def test_sizes_are_those_the_config_works_at_and_min_nodes_defaults_to_nodes():
    assert Job.from_body(S3_JOB).spec.sizes == (2,) and not Job.from_body(S3_JOB).spec.elastic
    job = elastic(nodes=4, min_nodes=1, config=batch_config(4))
    assert job.spec.sizes == (1, 2, 4) and job.spec.min_nodes_note == ""  # 3 does not divide a batch of 4


def test_tensor_parallel_rounds_min_nodes_up_and_says_why():
    job = elastic(nodes=4, min_nodes=1, config={**batch_config(4), "model": {"tensor_model_parallel_size": 2}})
    assert job.spec.sizes == (2, 4)
    assert job.spec.min_nodes_note.startswith("spec.minNodes 1 rounded up to 2 (1 node(s): spec.config: "
                                              "model.tensor_model_parallel_size")
    status = run(job, {}).status
    assert (status["minNodes"], status["sizes"]) == (2, [2, 4]) and "rounded up to 2" in status["minNodesNote"]


@pytest.mark.parametrize(("spec", "words"), [
    ({"nodes": 2, "minNodes": 3}, "spec.minNodes: must be at most spec.nodes (2), got 3"),
    ({"nodes": 2, "minNodes": 0}, "spec.minNodes: must be an integer >= 1, got 0"),
    ({"nodes": 4, "minNodes": 3, "config": yaml.safe_dump(batch_config(8))},
     "spec.minNodes: no size in [3, 3] works for spec.config; 3 node(s): spec.config: train.global_batch_size: "
     "8 is not divisible by micro_batch_size*data_parallel_size = 3"),
])
def test_a_range_that_cannot_work_is_refused_in_one_line(spec, words):
    with pytest.raises(SpecError) as err:
        Job.from_body(job_body(S3_JOB, **spec))
    assert str(err.value) == words and "\n" not in str(err.value)


def test_the_example_runs_at_the_sizes_its_comment_says():
    path = Path(__file__).resolve().parents[2] / "examples" / "trainingjob-elastic.yaml"
    (body,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "TrainingJob"]
    assert Job.from_body(body).spec.sizes == (2, 4)


# -- shrink ---------------------------------------------------------------------------------------------


def test_unschedulable_past_the_wait_shrinks_to_what_the_scheduler_placed():
    job = elastic()
    pods = [pod(0, node="a"), unplaced(1)]
    assert run(job, starting(age=29), pods).kind == "wait"  # within shrinkAfterSeconds
    action = run(job, starting(age=31), pods)
    assert action.kind == "restart" and action.status["reason"] == "Resized"
    assert action.status["resizeTo"] == 1 and action.status["resizes"] == {"shrinks": 1, "grows": 0}
    assert action.status.get("restarts", RESTARTS) == RESTARTS  # free
    assert action.status["nextAttemptTime"] is None  # at once
    assert set(action.delete_pods) == {"gpt-1-0", "gpt-1-1"}
    assert action.events[0].reason == "Resized" and "2 -> 1 nodes" in action.events[0].message
    assert "Insufficient cpu" in action.events[0].message


def test_a_startup_timeout_shorter_than_the_shrink_wait_shrinks_instead_of_ending_the_attempt():
    """startupTimeoutSeconds 20 < shrinkAfterSeconds 60 used to end every attempt at full size
    as StartupTimeout (never started 1/5, 2/5, ...). Pods the elastic rule waits on shrink the job at whichever
    timeout is shorter."""
    job = Job.from_body(job_body(S3_JOB, nodes=2, minNodes=1, startupTimeoutSeconds=20))  # shrinkAfterSeconds 60
    pods = [pod(0, node="a"), unplaced(1)]
    assert run(job, starting(age=19), pods).kind == "wait"
    action = run(job, starting(age=21), pods)
    assert action.kind == "restart" and action.status["reason"] == "Resized" and action.status["resizeTo"] == 1
    assert action.status.get("restarts", RESTARTS) == RESTARTS  # not a never-started attempt
    assert "Unschedulable for more than startupTimeoutSeconds (20s)" in action.events[0].message
    due = next_due(job, Observed(now=NOW, status=starting(age=15), pods=tuple(
        PodView(**{**vars(p), "scheduler_seen": True}) for p in pods)), interval=5.0, jitter=0.5)
    assert 5 < due < 6.1  # the operator wakes for it
    placed = [pod(0, node="a"), pod(1, node="b", phase="Pending")]  # nothing to shrink for: StartupTimeout
    assert run(job, starting(age=21), placed).status["reason"] == "StartupTimeout"


def test_the_operator_wakes_when_the_shrink_is_due():
    job, placed = elastic(), pod(0, node="a", scheduler_seen=True)
    stuck = PodView(**{**vars(unplaced(1)), "scheduler_seen": True})
    due = next_due(job, Observed(now=NOW, status=starting(age=15), pods=(placed, stuck)), interval=5.0, jitter=0.5)
    assert 15 < due < 16.6  # shrinkAfterSeconds 30, 15 s gone; not the 600 s startup timeout
    both = (placed, pod(1, node="b", scheduler_seen=True))
    assert next_due(job, Observed(now=NOW, status=starting(age=15), pods=both), interval=5.0, jitter=0.5) > 300


def test_shrink_picks_the_largest_working_size_at_most_the_placed_pods():
    job = elastic(nodes=8, min_nodes=2, config=batch_config(8))  # sizes 2, 4, 8
    placed = [pod(r, node="a") for r in range(5)] + [unplaced(r) for r in range(5, 8)]
    assert run(job, starting(nodes=8), placed).status["resizeTo"] == 4
    nothing = [unplaced(r) for r in range(8)]
    assert run(job, starting(nodes=8), nothing).status["resizeTo"] == 2  # none placed: the smallest


@pytest.mark.parametrize("job", [Job.from_body(S3_JOB), elastic()], ids=["not elastic", "at minNodes"])
def test_no_shrink_below_the_range(job):
    size = job.spec.sizes[0]
    status = starting(nodes=size, age=31)
    pods = [unplaced(r) for r in range(size)]
    assert run(job, status, pods).kind == "wait"
    assert run(job, starting(nodes=size, age=601), pods).status["reason"] == "StartupTimeout"  # as before


def test_next_attempt_has_the_resized_size_then_the_full_size_after_a_preemption():
    job = elastic()
    resized = {**starting(), "phase": "Restarting", "reason": "Resized", "resizeTo": 1}
    action = run(job, resized)
    assert action.create_attempt == 2 and action.nodes == 1
    assert action.status["nodes"] == 1 and action.status["resizeTo"] is None
    assert "(1 pods)" in action.events[-1].message
    preempted = {**starting(attempt=2, nodes=1), "phase": "Restarting", "reason": "Preempted"}
    assert run(job, preempted).nodes == 2  # any other restart tries the full size


# -- running shrunk: probes, grow --------------------------------------------------------------------------


def shrunk(**extra):
    return {**starting(attempt=2, nodes=1), "phase": "Running", "reason": "Running", **extra}


def test_running_shrunk_keeps_one_probe_per_missing_rank():
    job = elastic(nodes=3, min_nodes=1, config=batch_config(6))
    action = run(job, shrunk(), [pod(0, attempt=2)])
    assert action.create_probes == (1, 2) and not action.delete_pods
    ended = pod(1, attempt=2, role="probe", phase="Failed", pod_reason="Evicted")
    waiting = pod(2, attempt=2, role="probe", phase="Pending")
    action = run(job, shrunk(), [pod(0, attempt=2), ended, waiting])
    assert action.kind == "wait" and action.delete_pods == ("gpt-2-probe-1",) and action.create_probes == ()


def test_all_probes_bound_grows_back_by_a_graceful_stop():
    job = elastic()
    probe = pod(1, attempt=2, role="probe", phase="Pending", node="node-b")
    action = run(job, shrunk(iteration=17), [pod(0, attempt=2, node="node-a"), probe])
    assert action.kind == "restart" and action.status["reason"] == "Resized" and action.status["resizeTo"] == 2
    assert action.status["resizes"] == {"shrinks": 0, "grows": 1}
    assert action.status.get("restarts", RESTARTS) == RESTARTS
    assert action.delete_pods == ("gpt-2-0",)  # the trainer saves on SIGTERM; the probe holds the room meanwhile
    assert "1 -> 2 nodes" in action.events[0].message and "node-b" in action.events[0].message
    gone = {**shrunk(), **action.status}
    assert run(job, gone, [probe]).delete_pods == ("gpt-2-probe-1",)  # then the probes, then attempt 3
    nxt = run(job, gone)
    assert nxt.create_attempt == 3 and nxt.nodes == 2


def test_a_shrunk_attempt_succeeds_with_its_own_size():
    job = elastic()
    done = pod(0, attempt=2, phase="Succeeded", exit_code=0, termination={"exitCode": 0, "iteration": 40,
                                                                          "trainIters": 40})
    probe = pod(1, attempt=2, role="probe", phase="Pending")
    action = run(job, shrunk(), [done, probe])
    assert action.kind == "succeed" and set(action.delete_pods) == {"gpt-2-probe-1"}


# -- build ------------------------------------------------------------------------------------------------


def test_an_attempt_is_built_at_its_size():
    job = elastic(nodes=2, queueName="q", scheduling={"gang": "coscheduling"})
    manifests = build(job, 2, nodes=1)
    pods = [m for m in manifests if m["kind"] == "Pod"]
    (group,) = [m for m in manifests if m["kind"] == "PodGroup"]
    assert group["spec"]["minMember"] == 1 and len(pods) == 1
    env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
    assert (env["WORLD_SIZE"], env["NNODES"]) == ("1", "1")
    assert pods[0]["metadata"]["annotations"][KUEUE_COUNT_ANNOTATION] == "1"


def test_a_probe_is_the_ranks_pod_with_a_sleep_and_no_group():
    job = elastic(nodes=3, min_nodes=1, config=batch_config(6), queueName="q",
                  resources={"requests": {"cpu": "7"}}, scheduling={"gang": "coscheduling", "nodeSelector": {"a": "b"}})
    rank = next(m for m in build(job, 2, nodes=3) if m["metadata"]["name"] == "gpt-2-2")
    probe = build_probe_pod(job, 2, 2, nodes=1)
    assert probe["metadata"]["name"] == "gpt-2-probe-2" and probe["metadata"]["labels"][LABEL_ROLE] == "probe"
    (container,) = probe["spec"]["containers"]
    assert container["resources"] == rank["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "7"}}
    assert "kubetron.launch" not in " ".join(container["command"]) and "env" not in container
    for key in ("nodeSelector", "schedulerName", "securityContext"):
        assert probe["spec"][key] == rank["spec"][key]
    assert "scheduling.x-k8s.io/pod-group" not in probe["metadata"]["labels"]  # not a member of the gang
    assert probe["metadata"]["labels"][KUEUE_GROUP_LABEL] == "gpt-2-probes"  # Kueue admits the missing ranks
    assert probe["metadata"]["annotations"][KUEUE_COUNT_ANNOTATION] == "2"
