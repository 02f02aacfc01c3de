"""Tenant safety without a cluster (the same on a real API server: test_tenancy_on_kube.py; docs/security.md).

A TrainingJob is written by a tenant: every name it carries is a Kubernetes name (the CRD's schema and the
operator's admission), request paths refuse anything else, what one job makes the operator create is
bounded, `$` in overrides reaches the trainer as written, and what pods and stores serve is read bounded
(http_get, untrusted) and never reaches a log line, an Event or status with its control characters.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import pathlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import jsonschema
import kopf
import pytest
import yaml
from kubetron.contract.progress import (
    exiting_job_line,
    hang_detected_line,
    parse_progress,
    restarted_in_place_line,
    saved_checkpoint_line,
    starting_job_line,
    summarize_events,
)
from kubetron_operator import handlers
from kubetron_operator.api_calls import InvalidName, Kube, api_path
from kubetron_operator.build import build_pod, trainer_args
from kubetron_operator.decide import decide
from kubetron_operator.deps import Deps
from kubetron_operator.events import QUEUED_PER_JOB, EventPoster
from kubetron_operator.main import OneLineFormatter
from kubetron_operator.model import ATTEMPT_LIMIT, NAME_PATTERN, Job, SpecError
from kubetron_operator.observe import Observed, PodView
from kubetron_operator.trainer_reports import http_get, status_endpoint, store_log
from kubetron_operator.untrusted import LOG_LIMIT, Untrusted, clean, load_json

from tests.operator.endpoints import Endpoint
from tests.operator.jobs import PVC_JOB, S3_JOB, job_body
from tests.operator.local_pods import expand

pytestmark = pytest.mark.cluster

CRD = pathlib.Path(__file__).parents[2] / "crds" / "trainingjob.yaml"
NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
TRAVERSAL = "../../other-ns/secrets/their-creds"


def schema():
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def with_s3(**s3):
    body = copy.deepcopy(S3_JOB)
    body["spec"]["storage"]["s3"].update(s3)
    return body


# -- 1. names -------------------------------------------------------------------------------------------

NAMES = [  # (where in the spec, the body with a traversal there)
    ("spec.storage.s3.secretRef.name", with_s3(secretRef={"name": TRAVERSAL})),
    ("spec.storage.pvc.claimName", job_body(storage={"pvc": {"claimName": "../claims/x"}})),
    ("spec.serviceAccountName", job_body(serviceAccountName="../../kube-system/serviceaccounts/admin")),
    ("spec.imagePullSecrets[0].name", job_body(imagePullSecrets=[{"name": "a/b"}])),
    ("spec.scheduling.priorityClassName", job_body(scheduling={"priorityClassName": "Upper"})),
    ("spec.scheduling.schedulerName", job_body(scheduling={"schedulerName": "x/y"})),
    ("spec.queueName", job_body(queueName="../q")),
    ("spec.storage.s3.bucket", with_s3(bucket="b/../../c")),
    ("spec.storage.s3.region", with_s3(region="evil.example/x")),
    ("spec.storage.s3.endpoint", with_s3(endpoint="http://s3:9000/other-bucket?x=")),
    ("spec.storage.s3.prefix", with_s3(prefix="runs/../../other-team")),
]


@pytest.mark.parametrize(("field", "body"), NAMES, ids=[n[0] for n in NAMES])
def test_every_name_a_spec_carries_is_checked_by_the_crd_and_by_admission(field, body):
    with pytest.raises(SpecError) as info:
        Job.from_body(body)
    assert info.value.field == field and "\n" not in str(info.value)
    if field != "spec.storage.s3.prefix":  # the prefix is a CEL rule (test_tenancy_on_kube.py)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(body, schema())


def test_names_in_the_pod_template_are_checked_by_the_crd():
    template = {"spec": {"volumes": [{"name": "v", "secret": {"secretName": TRAVERSAL}}],
                         "containers": [{"name": "trainer", "envFrom": [{"secretRef": {"name": "../x"}}]}]}}
    for bad in ({"volumes": template["spec"]["volumes"]}, {"containers": template["spec"]["containers"]}):
        with pytest.raises(jsonschema.ValidationError, match="does not match"):
            jsonschema.validate(job_body(podTemplate={"spec": bad}), schema())
    env = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": TRAVERSAL, "key": "k"}}}]
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        jsonschema.validate(job_body(env=env), schema())


def test_the_crds_name_pattern_is_the_operators():
    spec = schema()["properties"]["spec"]["properties"]
    for where in (spec["serviceAccountName"], spec["storage"]["properties"]["s3"]["properties"]["secretRef"]
                  ["properties"]["name"], spec["storage"]["properties"]["pvc"]["properties"]["claimName"]):
        assert where["pattern"] == NAME_PATTERN and where["maxLength"] == 253


def test_the_path_builder_refuses_what_is_not_a_name_and_sends_nothing():
    """Whatever got past the schema (a job stored before it said so): no request leaves with that path."""
    sent = []
    kube = Kube(lambda *call: sent.append(call) or (200, b"{}"))
    with pytest.raises(InvalidName, match="secret name '../../other-ns/secrets/their-creds' is not a Kubernetes"):
        kube.secret_data("team-a", TRAVERSAL)
    for bad in ("..", "a/b", "a%2Fb", "A", "a b", "a\nb"):
        with pytest.raises(InvalidName):
            kube.get("v1", "Pod", "team-a", bad)
        with pytest.raises(InvalidName):
            api_path("", "v1", "pods", bad)
    assert sent == []
    assert api_path("", "v1", "secrets", "team-a", "s3-creds.v2") == "/api/v1/namespaces/team-a/secrets/s3-creds.v2"


def test_a_job_without_secret_ref_gives_its_pods_no_keys():
    job = Job.from_body(with_s3(secretRef=None) | {})
    assert job.spec.storage.secret_name == ""
    pod = build_pod(job, 1, 0)
    assert not [e for e in pod["spec"]["containers"][0]["env"] if e["name"].startswith("AWS_") and "KEY" in e["name"]]


# -- 7. amplification -----------------------------------------------------------------------------------


def test_what_one_attempt_creates_is_bounded():
    big = "train:\n  train_iters: 4\n" + "#" * 16_000 + "\n"
    with pytest.raises(SpecError) as info:
        Job.from_body(job_body(nodes=4096, config=big))
    assert info.value.field == "spec.nodes" and "more than 64 MiB" in str(info.value)
    crd = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = [r for r in crd["x-kubernetes-validations"] if "self.nodes <=" in r["rule"]]
    assert str(ATTEMPT_LIMIT) in rule["rule"]
    sidecars = [{"name": f"s{i}", "image": "x", "args": ["y" * 60_000]} for i in range(8)]
    with pytest.raises(SpecError, match="spec.nodes: 200 pods of 477 KiB"):  # the template is copied too
        Job.from_body(job_body(nodes=200, podTemplate={"spec": {"containers": sidecars}}))
    Job.from_body(job_body(nodes=4096))  # a small config at the largest size is fine


# -- 8. $(VAR) in overrides ----------------------------------------------------------------------------


def test_overrides_reach_the_trainer_as_written():
    """The kubelet expands $(VAR) in args from the container's env (and $$ to $): the pod carries every $
    doubled, so the trainer gets the override the operator validated."""
    written = ["logger.wandb_exp_name=run-$(NODE_RANK)-$$-$(HOME", "logger.tensorboard_dir=/ckpt/$(KUBETRON_JOB_ID)"]
    job = Job.from_body(job_body(overrides=written))
    pod = build_pod(job, 1, 1)
    container = pod["spec"]["containers"][0]
    assert "logger.wandb_exp_name=run-$$(NODE_RANK)-$$$$-$$(HOME" in container["args"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    received = [expand(a, env) for a in container["args"]]
    assert received == trainer_args(job) and set(written) <= set(received)


# -- 6. what pods say -----------------------------------------------------------------------------------


def worker(name: str, message: str, code: int = 1) -> dict:
    return {"metadata": {"name": name, "labels": {"kubetron.dev/attempt": "1", "kubetron.dev/rank": name[-1]},
                         "creationTimestamp": "2026-11-22T11:00:00Z"},
            "spec": {"nodeName": "n1"},
            "status": {"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": {"terminated": {
                "exitCode": code, "reason": "Error", "message": message, "startedAt": "2026-11-22T11:00:01Z"}}}]}}


HOSTILE = [
    ("nested", '{"exitCode": 1, "x": ' + "[" * 2000 + "]" * 2000 + "}", "nested more than 16 levels"),
    ("huge int", '{"exitCode": 1, "iteration": 1' + "0" * 4000 + "}", "beyond int64"),
    ("too long", '{"exitCode": 1, "message": "' + "x" * 5000 + '"}', "more than 4096"),
    ("above int64", '{"exitCode": 1, "lastCheckpoint": 9223372036854775808}', "beyond int64"),
    ("negative", '{"exitCode": 1, "trainIters": -4}', "trainIters is not a count"),
    ("restarts a string", '{"exitCode": 0, "inPlaceRestarts": "7"}', "inPlaceRestarts is not a count"),
    ("infinite", '{"exitCode": 1, "iteration": 1e999}', "beyond the range of a double"),
]


@pytest.mark.parametrize(("case", "message", "why"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_termination_message_is_ignored_and_the_job_still_decided(case, message, why):
    pods = tuple(PodView.from_pod(worker(f"gpt-1-{r}", message), NOW) for r in (0, 1))
    assert all(p.termination is None and why in p.refused for p in pods)
    status = {"phase": "Running", "attempt": 1, "restarts": {}}
    action = decide(Job.from_body(PVC_JOB), Observed(now=NOW, status=status, pods=pods))
    assert action.status["reason"] == "TrainerError" and action.status["phase"] == "Restarting"
    assert action.status["restarts"]["failures"] == 1


def test_control_characters_never_reach_status_events_or_the_log():
    forged = "boom\n2026-11-22 12:00:00,000 INFO kubetron.api: job gpt Succeeded\x1b[2K\u2028"
    pod = PodView.from_pod(worker("gpt-1-0", json.dumps({"exitCode": 1, "message": forged})), NOW)
    assert pod.termination["message"] == "boom\\n2026-11-22 12:00:00,000 INFO kubetron.api: job gpt Succeeded" \
                                          "\\x1b[2K\\u2028"
    record = logging.LogRecord("kubetron", logging.WARNING, __file__, 1, "pod said: %s", (forged,), None)
    line = OneLineFormatter("%(levelname)s %(message)s").format(record)
    assert "\n" not in line and "\x1b" not in line and line.startswith("WARNING pod said: boom\\n")
    assert clean("a\tb\rc\x00d\x9be") == "a\\tb\\rc\\x00d\\x9be"


def test_bounded_json():
    assert load_json('{"a": [1, 2.5, "x"]}', 100) == {"a": [1, 2.5, "x"]}
    for text, why in (("[" * 17 + "]" * 17, "nested"), ('"' + "x" * 200 + '"', "more than 100"),
                      ("9223372036854775808", "int64"), ("NaN", "not a number"), ('{"a": "[[[[[[[[[[[[[[[[[["}', "")):
        if not why:  # brackets inside a string do not nest
            assert load_json(text, 100) == {"a": "[" * 18}
            continue
        with pytest.raises(Untrusted, match=why):
            load_json(text, 100)


# -- 4. rank 0's status endpoint -----------------------------------------------------------------------


def rank0(port_ip: str = "127.0.0.1") -> list[PodView]:
    return [PodView(name="gpt-1-0", attempt=1, rank=0, phase="Running", ip=port_ip)]


def test_rank0s_endpoint_is_read_bounded(monkeypatch):
    monkeypatch.setattr(status_endpoint, "LIVE_DEADLINE", 0.6)  # the real 2 s: test_tenancy_on_kube.py
    target = Endpoint.serve(b'{"iteration": 999}')
    hops = Endpoint.redirect(f"{target.url}/status")
    drip = Endpoint.drip(every=0.2)
    big = Endpoint.serve(b'{"loss": 1.0, "pad": "' + b"x" * 100_000 + b'"}')
    deep = Endpoint.serve(b'{"iteration": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    try:
        read = status_endpoint.read_live(rank0(), 1, hops.port)
        assert read.status is None and "a redirect, not followed" in read.problem and target.requests == []
        t0 = time.monotonic()
        read = status_endpoint.read_live(rank0(), 1, drip.port)
        # a byte every 0.2 s for hours: only the 0.6 s deadline ends it (the bound leaves a loaded machine room)
        assert time.monotonic() - t0 < 3.0 and "no answer within 0.6s" in read.problem
        assert "longer than 65536 bytes" in status_endpoint.read_live(rank0(), 1, big.port).problem
        assert "nested more than" in status_endpoint.read_live(rank0(), 1, deep.port).problem
        only_ip = status_endpoint.read_live(rank0("node-1.example"), 1, target.port)
        assert only_ip == status_endpoint.LiveRead()  # only the pod's IP
        assert status_endpoint.read_live(rank0(), 1, target.port).status["iteration"] == 999
        huge = status_endpoint.read_live(rank0(), 1, 8080, lambda url: {"iteration": 10**30})
        assert huge.status is None and "iteration is not a count" in huge.problem
        huge = status_endpoint.read_live(rank0(), 1, 8080, lambda url: {"loss": 10**400})
        assert huge.status is None and "beyond the range of a double" in huge.problem
    finally:
        for e in (target, hops, drip, big, deep):
            e.close()
    with pytest.raises(ValueError, match="not an IP address"):
        http_get.get("http://example.com/status", limit=10, deadline=1, ip_only=True)


def hang_report(**kw):
    return {"rank": 1, "nodeRank": 1, "localRank": 0, "phase": "train", "iteration": 35, "idleSeconds": 47.2,
            "timeoutSeconds": 45.0, "state": "stopped", "where": "", "ranks": 2, "stacks": "", "restart": 1, **kw}


def started(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).isoformat().replace("+00:00", "Z")


SPENT = {"steps": 10, "train": 5.0, "checkpoint": 1.0, "evaluation": 0.0}
# What rank 0's endpoint says -> why it is refused ("" for taken): counts within the spec, times a process can spend.
LIVE = [
    ("within the spec", {"inPlaceRestarts": 2, "hangs": 1}, ""),
    ("restarts beyond maxInPlaceRestarts", {"inPlaceRestarts": 300}, "more than the job's maxInPlaceRestarts 3"),
    ("a billion of them", {"inPlaceRestarts": 10**9}, "more than the job's maxInPlaceRestarts 3"),
    ("hangs beyond the restarts", {"inPlaceRestarts": 1, "hangs": 2**63 - 1}, "hangs 9223372036854775807 is more"),
    ("negative hangs", {"hangs": -1}, "hangs is not a count"),
    ("a time a process spent", {"trainerTime": {"started": started(60), **SPENT}}, ""),
    ("steps -1, train 1e308", {"trainerTime": {"started": started(60), **SPENT, "steps": -1, "train": 1e308}},
     "trainerTime.steps is not a count"),
    ("1e308 seconds", {"trainerTime": {"started": started(60), **SPENT, "train": 1e308}},
     "trainerTime.train is not a number of seconds"),
    ("more seconds than it ran", {"trainerTime": {"started": started(60), **SPENT, "train": 2000.0}},
     "more than its process has run"),
    ("a start in the future", {"trainerTime": {"started": started(-3600), **SPENT}}, "more than its process has run"),
    ("negative seconds", {"trainerTime": {"started": started(60), **SPENT, "checkpoint": -1.0}},
     "trainerTime.checkpoint is not a number of seconds"),
    ("no start", {"trainerTime": {**SPENT, "started": "yesterday"}}, "trainerTime.started is not a timestamp"),
]


@pytest.mark.parametrize(("case", "said", "why"), LIVE, ids=[c[0] for c in LIVE])
def test_rank0s_counts_and_times_are_taken_only_within_what_the_spec_and_the_clock_allow(case, said, why):
    read = status_endpoint.read_live(rank0(), 1, 8080, lambda url: {"iteration": 5, **said}, max_in_place=3, now=NOW)
    assert (read.status is None) == bool(why) and why in read.problem
    if not why:
        assert read.status["iteration"] == 5


def test_strings_of_rank0s_hang_report_and_restart_cause_are_cut_short():
    said = {"inPlaceRestarts": 1, "hangs": 1, "lastHang": hang_report(where="w" * 60_000, stacks="s" * 60_000),
            "lastRestart": {"restart": 1, "rank": 1, "nodeRank": 1, "how": "h\n" * 30_000}}
    status = status_endpoint.read_live(rank0(), 1, 8080, lambda url: said, max_in_place=3, now=NOW).status
    assert len(status["lastHang"]["where"]) == 300 and len(status["lastHang"]["stacks"]) == 512
    assert len(status["lastRestart"]["how"]) == 200 and "\n" not in status["lastRestart"]["how"]


def test_a_termination_messages_hang_is_kept_its_numbers_checked():
    kept = PodView.from_pod(worker("gpt-1-0", json.dumps({"exitCode": 7, "hang": hang_report(where="w" * 900)}), 7),
                            NOW)
    assert kept.termination["hang"]["rank"] == 1 and len(kept.termination["hang"]["where"]) == 300
    refused = PodView.from_pod(worker("gpt-1-0", json.dumps({"exitCode": 7, "hang": hang_report(rank=-1)}), 7), NOW)
    assert refused.termination is None and "hang.rank is not a count" in refused.refused


def test_the_progress_log_counts_no_more_restarts_or_hangs_than_the_spec_allows(monkeypatch):
    job = Job.from_body(job_body(S3_JOB, maxInPlaceRestarts=2))
    lines = [restarted_in_place_line(10, n, 40, num_gpus=2, job_id="ml/gpt/1") for n in (1, 2, 300)]
    lines += [hang_detected_line(hang_report(restart=0), 40, num_gpus=2, job_id="ml/gpt/1")] * 50
    monkeypatch.setattr(store_log, "signed_url", lambda *a: "http://store/progress.txt")
    monkeypatch.setattr(store_log, "read_tail", lambda *a: "\n".join(lines) + "\n")
    read = store_log.read_s3_progress(job, Kube(lambda *a: (500, b"")))
    assert read.summary["inPlaceRestarts"] == {"ml/gpt/1": 2} and read.summary["hangs"] == {"ml/gpt/1": 2}
    assert "1 line(s) ignored" in read.warnings[0] and "more hangs than maxInPlaceRestarts 2" in read.warnings[1]


class Blocked:
    """A Kube whose post_event waits until `release` is set; it counts what it posted."""

    def __init__(self):
        self.release, self.posted = threading.Event(), []

    def post_event(self, involved, type_, reason, message, now):
        self.release.wait(30)
        self.posted.append((involved["metadata"]["uid"], reason))


def test_one_jobs_events_queue_up_to_a_bound_and_never_ahead_of_every_other_jobs(caplog):
    kube = Blocked()
    poster = EventPoster(kube)  # type: ignore[arg-type]
    logger = logging.getLogger("test")
    body = {"metadata": {"name": "gpt", "namespace": "a", "uid": "flood"}}
    for n in range(1000):
        poster.post(body, "Warning", "RestartedInPlace", f"restart {n}", "t", logger)
    poster.post({"metadata": {"name": "gpt", "namespace": "b", "uid": "other"}}, "Normal", "Running", "x", "t",
                logger)
    kube.release.set()
    deadline = time.monotonic() + 30
    while len(kube.posted) < QUEUED_PER_JOB + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kube.posted.count(("flood", "RestartedInPlace")) == QUEUED_PER_JOB and ("other", "Running") in kube.posted
    assert caplog.text.count("not posted") == 1 and "events of a/gpt not posted from RestartedInPlace on" in caplog.text


def test_a_line_of_the_operators_log_is_cut_short():
    record = logging.LogRecord("kubetron", logging.WARNING, __file__, 1, "pod said: %s", ("x" * 10**6,), None)
    assert len(OneLineFormatter("%(message)s").format(record)) == LOG_LIMIT


# -- 3. the progress log: its tail, bounded ------------------------------------------------------------


def long_log(attempts: int = 80, saves: int = 60) -> str:
    lines = []
    for a in range(1, attempts + 1):
        job_id = f"ml/gpt/{a}"
        lines.append(starting_job_line((a - 1) * saves, 10**6, num_gpus=16, job_id=job_id))
        for s in range((a - 1) * saves + 1, a * saves + 1):
            lines.append(saved_checkpoint_line(s, 1.0, 1.0, 1e15 * s, 4096 * s, 10**6, num_gpus=16, job_id=job_id))
        lines.append(exiting_job_line(a * saves, "SavedOnSignal", 10**6, num_gpus=16, job_id=job_id))
    return "\n".join(lines) + "\n"


def test_the_tail_of_a_long_log_says_what_the_whole_log_says():
    """What the operator takes from the summary is the same from the 256 KiB tail as from the whole log."""
    text = long_log()
    assert len(text) > 3 * store_log.TAIL_BYTES
    whole = summarize_events(parse_progress(text))
    tail = text[-store_log.TAIL_BYTES:].partition("\n")[2]
    part = summarize_events(parse_progress(tail))
    for key in ("lastCheckpoint", "trainIters", "iteration", "completed", "inPlaceRestarts"):
        assert part[key] == whole[key], key
    assert part["jobIterations"]["ml/gpt/80"] == whole["jobIterations"]["ml/gpt/80"]


def test_the_store_is_read_by_its_tail_within_a_deadline(monkeypatch):
    monkeypatch.setattr(store_log, "READ_DEADLINE", 0.6)  # the real 3 s: test_tenancy_on_kube.py
    text = long_log().encode()
    store = Endpoint.objects({"/bkt/runs/ml/gpt/progress.txt": text})
    drip = Endpoint.drip(every=0.2)
    whole = Endpoint.serve(text)  # a store that ignores Range
    keys = ("AKID", "SECRET", None)
    try:
        tail = store_log.read_tail(store_log.presign(store.url, "", "bkt", "runs/ml/gpt/progress.txt", keys), "s")
        assert store.requests[0]["headers"]["Range"] == f"bytes=-{store_log.TAIL_BYTES}"
        assert len(tail) < store_log.TAIL_BYTES and tail.startswith("20")  # the cut first line dropped
        assert "X-Amz-Credential=AKID%2F" in store.requests[0]["path"]
        t0 = time.monotonic()
        with pytest.raises(store_log.Unread) as slow:
            store_log.read_tail(f"{drip.url}/bkt/key", "slow")
        assert slow.value.reason == "StoreTimeout" and time.monotonic() - t0 < 3.0  # a byte every 0.2 s for hours
        with pytest.raises(store_log.Unread) as large:
            store_log.read_tail(f"{whole.url}/bkt/key", "whole")
        assert large.value.reason == "StoreTooLarge"
        assert store_log.read_tail(f"{store.url}/bkt/none", "s") == ""  # no log yet
    finally:
        for e in (store, drip, whole):
            e.close()


# -- liveness -------------------------------------------------------------------------------------------


def test_liveness_fails_while_work_waits_for_a_thread(monkeypatch):
    monkeypatch.setattr(handlers, "STARVED_AFTER", 0.3)
    deps = Deps(kube=Kube(lambda *a: (200, b"{}")), executor=ThreadPoolExecutor(1))
    memo = kopf.Memo(deps=deps)
    release = threading.Event()

    async def scenario():
        assert await handlers.pool_health(memo) == {"oldestWaitSeconds": 0.0}
        blocker = asyncio.ensure_future(deps.pools.run(deps.executor, release.wait, 10))
        waiting = asyncio.ensure_future(deps.pools.run(deps.executor, lambda: "done"))
        await asyncio.sleep(0.5)
        with pytest.raises(kopf.PermanentError, match="waited"):
            await handlers.pool_health(memo)
        release.set()
        assert await waiting == "done" and await blocker
        assert (await handlers.pool_health(memo))["oldestWaitSeconds"] == 0.0

    asyncio.run(scenario())
