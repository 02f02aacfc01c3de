"""build(job, attempt): the manifests one attempt runs as. Pure, no cluster."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import jsonschema
import pytest
import yaml
from kubetron.contract import recovery
from kubetron_operator.apply import with_token
from kubetron_operator.build import (
    CONFIG_PATH,
    attempt_objects,
    build,
    build_probe_pod,
    job_objects,
    master_addr,
    rank_command,
)
from kubetron_operator.model import Job, SpecError
from kubetron_operator.render import render_file

from tests.operator.jobs import PVC_JOB, S3_JOB, job_body

pytestmark = pytest.mark.process

CRD = pathlib.Path(__file__).parents[2] / "crds" / "trainingjob.yaml"


def by_kind(manifests, kind):
    return [m for m in manifests if m["kind"] == kind]


def env_of(pod):
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


def test_attempt_objects_names_and_owner():
    manifests = build(Job.from_body(PVC_JOB), 3, expected_iteration=20)
    assert [m["kind"] for m in manifests] == ["Service", "Secret", "Pod", "Pod"]  # the Secret: the pods' token
    assert [m["metadata"]["name"] for m in by_kind(manifests, "Pod")] == ["gpt-3-0", "gpt-3-1"]
    for m in manifests:
        assert m["metadata"]["namespace"] == "ml"
        assert m["metadata"]["labels"]["kubetron.dev/job"] == "gpt"
        (owner,) = m["metadata"]["ownerReferences"]
        assert owner == {"apiVersion": "kubetron.dev/v1alpha1", "kind": "TrainingJob", "name": "gpt",
                         "uid": "uid-123", "controller": True, "blockOwnerDeletion": True}
    pod = by_kind(manifests, "Pod")[1]
    assert pod["metadata"]["labels"]["kubetron.dev/attempt"] == "3"
    assert pod["metadata"]["labels"]["kubetron.dev/rank"] == "1"
    # The trainer's config travels on the pod: the kubelet writes the annotation to the file the trainer reads.
    assert pod["metadata"]["annotations"]["kubetron.dev/config"] == PVC_JOB["spec"]["config"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
    assert volume["downwardAPI"]["items"] == [
        {"path": "config.yaml", "fieldRef": {"fieldPath": "metadata.annotations['kubetron.dev/config']"}}]
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "config"]
    assert f"{mount['mountPath']}/config.yaml" == CONFIG_PATH and mount["readOnly"] is True


def test_headless_service_resolves_rank0():
    job = Job.from_body(PVC_JOB)
    svc, _, pod0, _ = build(job, 1)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert pod0["spec"]["hostname"] == "gpt-1-0" and pod0["spec"]["subdomain"] == svc["metadata"]["name"]
    assert master_addr(job, 1) == "gpt-1-0.gpt.ml.svc"


@pytest.mark.parametrize(("gpus", "nproc"), [(0, 1), (8, 8)])
def test_rendezvous_env(gpus, nproc):
    pods = by_kind(build(Job.from_body(job_body(gpusPerNode=gpus, nodes=3)), 2, expected_iteration=17), "Pod")
    for rank, pod in enumerate(pods):
        env = {k: v.get("value") for k, v in env_of(pod).items()}
        assert env["MASTER_ADDR"] == "gpt-2-0.gpt.ml.svc"
        assert env["MASTER_PORT"] == "29500"
        assert env["NNODES"] == "3" and env["NODE_RANK"] == str(rank)
        assert env["NPROC_PER_NODE"] == str(nproc) and env["WORLD_SIZE"] == str(3 * nproc)
        assert env["KUBETRON_JOB_ID"] == "ml/gpt/2"
        assert env["KUBETRON_EXPECTED_ITERATION"] == "17"
        assert env["KUBETRON_TERMINATION_LOG"] == "/dev/termination-log"
        assert env["KUBETRON_STATUS_PORT"] == ("8080" if rank == 0 else "0")
        limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu") == (gpus or None)


@pytest.mark.parametrize(("spec", "expected"), [({}, "3"), ({"maxInPlaceRestarts": 0}, "0"),
                                                ({"maxInPlaceRestarts": 5}, "5")])
def test_max_in_place_restarts_reaches_the_launcher(spec, expected):
    """spec.maxInPlaceRestarts (default 3) becomes the launcher's bound (docs/recovery.md), in every pod."""
    pods = by_kind(build(Job.from_body(job_body(**spec)), 1), "Pod")
    assert {env_of(pod)["KUBETRON_MAX_IN_PLACE_RESTARTS"]["value"] for pod in pods} == {expected}


def test_pod_is_safe_and_never_restarts_itself():
    pod = by_kind(build(Job.from_body(job_body(terminationGracePeriodSeconds=300)), 1), "Pod")[0]
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == 300
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_command_pvc_store():
    pod = by_kind(build(Job.from_body(job_body(mode="finetune", overrides=["train.micro_batch_size=2"])), 1), "Pod")[0]
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["python3", "-m", "kubetron.launch"]
    assert c["args"] == ["finetune", "--config", "/etc/kubetron/config.yaml", "train.micro_batch_size=2",
                         "checkpoint.save=/ckpt/gpt", "checkpoint.load=/ckpt/gpt"]  # the store last: it wins
    assert {"name": "store", "mountPath": "/ckpt"} in c["volumeMounts"]
    assert {"name": "store", "persistentVolumeClaim": {"claimName": "ckpt"}} in pod["spec"]["volumes"]
    assert not any(k.startswith("AWS_") for k in env_of(pod))


def test_s3_credentials_come_from_the_secret():
    pod = by_kind(build(Job.from_body(S3_JOB), 1), "Pod")[0]
    env = env_of(pod)
    assert env["AWS_ACCESS_KEY_ID"] == {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://s3:9000" and env["AWS_REGION"]["value"] == "us-east-1"
    assert "checkpoint.save=s3://bkt/runs/ml/gpt" in pod["spec"]["containers"][0]["args"]
    assert not any(v["name"] == "store" for v in pod["spec"]["volumes"])


@pytest.mark.parametrize(("gang", "kind_api", "scheduler"), [
    ("volcano", "scheduling.volcano.sh/v1beta1", "volcano"),
    ("coscheduling", "scheduling.x-k8s.io/v1alpha1", "scheduler-plugins-scheduler"),
])
def test_gang_pod_group(gang, kind_api, scheduler):
    body = job_body(nodes=4, scheduling={"gang": gang, "priorityClassName": "train", "nodeSelector": {"gpu": "h100"},
                                         "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    manifests = build(Job.from_body(body), 2)
    (group,) = by_kind(manifests, "PodGroup")
    assert group["apiVersion"] == kind_api and group["spec"]["minMember"] == 4
    assert group["metadata"]["name"] == "gpt-2"
    for pod in by_kind(manifests, "Pod"):
        assert pod["spec"]["schedulerName"] == scheduler
        assert pod["spec"]["priorityClassName"] == "train"
        assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
        assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
        if gang == "volcano":
            assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gpt-2"
        else:
            assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "gpt-2"


def test_kubernetes_gang_pod_group_per_attempt_links_every_pod():
    """Kubernetes' own gang scheduling (KEP-4671): a scheduling.k8s.io/v1alpha2 PodGroup of the attempt's size
    (minCount), owned by the job; each pod names it in spec.schedulingGroup and keeps the default scheduler;
    an elastic job's smaller attempt gets a smaller minCount, its probes no group."""
    job = Job.from_body(job_body(nodes=4, minNodes=2, scheduling={"gang": "kubernetes"}))
    for attempt, size in ((1, 4), (2, 2)):
        manifests = build(job, attempt, nodes=size)
        (group,) = by_kind(manifests, "PodGroup")
        assert group["apiVersion"] == "scheduling.k8s.io/v1alpha2" and group["metadata"]["name"] == f"gpt-{attempt}"
        assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": size}}}
        assert group["metadata"]["ownerReferences"][0]["controller"] is True
        pods = by_kind(manifests, "Pod")
        assert len(pods) == size
        assert all(p["spec"]["schedulingGroup"] == {"podGroupName": f"gpt-{attempt}"} for p in pods)
        assert not any("schedulerName" in p["spec"] for p in pods)
    assert "schedulingGroup" not in build_probe_pod(job, 2, 3, 2)["spec"]


def test_no_pod_group_without_gang():
    assert not by_kind(build(Job.from_body(PVC_JOB), 1), "PodGroup")


def test_user_env_kept_but_cannot_override_contract():
    pod = by_kind(build(Job.from_body(job_body(env=[{"name": "NCCL_DEBUG", "value": "INFO"}])), 1), "Pod")[0]
    assert env_of(pod)["NCCL_DEBUG"]["value"] == "INFO"
    with pytest.raises(SpecError, match="MASTER_ADDR"):
        Job.from_body(job_body(env=[{"name": "MASTER_ADDR", "value": "x"}]))


@pytest.mark.parametrize(("change", "field"), [
    ({"storage": {}}, "spec.storage"),
    ({"storage": {"pvc": {"claimName": "a"}, "s3": {"bucket": "b", "secretRef": {"name": "c"}}}}, "spec.storage"),
    ({"nodes": 0}, "spec.nodes"),
    ({"mode": "sft"}, "spec.mode"),
    ({"image": ""}, "spec.image"),
])
def test_bad_specs_name_the_field(change, field):
    with pytest.raises(SpecError) as info:
        Job.from_body(job_body(**change))
    assert info.value.field == field


SPEC_ERRORS = [
    ("bad trainer config", {"config": "optimizer:\n  lr: -1\n"}, "spec.config", "optimizer.lr"),
    ("unknown config key", {"config": "train:\n  train_iterz: 4\n"}, "spec.config", "train_iters"),
    ("config not YAML", {"config": "train: [\n"}, "spec.config", "invalid YAML"),
    ("config too large for its annotation", {"config": "train:\n  train_iters: 4\n" + "#" * 200_000 + "\n"},
     "spec.config", "at most 192 KiB"),
    ("tp does not divide the world", {"config": "train:\n  train_iters: 4\nmodel:\n  tensor_model_parallel_size: 4\n"},
     "spec.config", "tensor_model_parallel_size"),
    ("bad override", {"overrides": ["train.nope=1"]}, "spec.overrides", "train.nope"),
    ("override redirects the store", {"overrides": ["checkpoint.save=s3://elsewhere/x"]}, "spec.overrides[0]",
     "checkpoint.save is set by the operator"),
    ("override redirects the load", {"overrides": ["train.train_iters=8", "checkpoint.load=/tmp"]},
     "spec.overrides[1]", "checkpoint.load"),
    ("same ports", {"statusPort": 29500}, "spec.statusPort", "masterPort"),
    ("gpu limit disagrees", {"gpusPerNode": 8, "resources": {"limits": {"nvidia.com/gpu": 4}}},
     "spec.resources.limits[nvidia.com/gpu]", "gpusPerNode (8)"),
]


@pytest.mark.parametrize(("case", "change", "field", "words"), SPEC_ERRORS, ids=[c[0] for c in SPEC_ERRORS])
def test_spec_checked_before_any_pod(case, change, field, words):
    with pytest.raises(SpecError) as info:
        Job.from_body(job_body(**change))
    assert info.value.field == field and words in str(info.value)
    assert "\n" not in str(info.value)  # one line


def test_config_check_runs_without_torch():
    """The operator image has no torch: checking spec.config must not need it."""
    code = ("import sys; from kubetron_operator.model import Job; from tests.operator.jobs import S3_JOB; "
            "Job.from_body(S3_JOB); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=pathlib.Path(__file__).parents[2])


def test_agreeing_gpu_limit_and_good_overrides_pass():
    job = Job.from_body(job_body(gpusPerNode=8, resources={"limits": {"nvidia.com/gpu": "8", "memory": "64Gi"}},
                                 overrides=["train.train_iters=8"]))
    assert job.spec.gpus_per_node == 8


def test_failing_nodes_are_avoided_next_attempt():
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]}]}}}
    job = Job.from_body(job_body(scheduling={"affinity": user}))
    pod = by_kind(build(job, 2, avoid_nodes=("n7", "n3")), "Pod")[0]
    required = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms = required["nodeSelectorTerms"]
    avoid = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n3", "n7"]}
    assert [t["matchExpressions"][-1] for t in terms] == [avoid, avoid]  # in every ORed term
    assert terms[0]["matchExpressions"][0]["values"] == ["a"]
    assert user["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"] == [{"key": "pool", "operator": "In", "values": ["a"]}]  # the job's spec is untouched
    plain = by_kind(build(Job.from_body(PVC_JOB), 2, avoid_nodes=("n7",)), "Pod")[0]
    assert plain["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [{**avoid, "values": ["n7"]}]}]}
    assert "affinity" not in by_kind(build(Job.from_body(PVC_JOB), 2), "Pod")[0]["spec"]


def test_name_must_fit_a_pod_hostname():
    body = job_body()
    body["metadata"]["name"] = "x" * 60
    with pytest.raises(SpecError, match="metadata.name"):
        Job.from_body(body)


def test_rank_command_runs_locally():
    argv, env = rank_command(Job.from_body(S3_JOB), 2, 1, expected_iteration=10)
    assert argv[:3] == ["python3", "-m", "kubetron.launch"] and argv[3] == "train"
    assert env["NODE_RANK"] == "1" and env["KUBETRON_EXPECTED_ITERATION"] == "10"
    assert "AWS_SECRET_ACCESS_KEY" not in env  # secrets are the caller's business


def test_build_is_deterministic():
    job = Job.from_body(S3_JOB)
    assert json.dumps(build(job, 5)) == json.dumps(build(job, 5))


def test_crd_schema_accepts_examples_and_rejects_bad_specs():
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["names"]["shortNames"] == ["tj"]
    (version,) = crd["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase", "Nodes", "Progress", "Iteration", "Restarts", "ETA", "Goodput", "Loss", "Age"]
    schema = version["schema"]["openAPIV3Schema"]
    for body in (PVC_JOB, S3_JOB):
        jsonschema.validate(body, schema)
    for bad in ({"nodes": 0}, {"mode": "sft"}, {"storage": {}}, {"gpusPerNode": -1},
                {"scheduling": {"gang": "kueue"}}, {"minNodes": 0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(job_body(**bad), schema)
    missing = job_body()
    del missing["spec"]["image"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(missing, schema)


def test_render_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(S3_JOB))
    docs = [d for d in yaml.safe_load_all(render_file(str(path))) if d]
    assert [d["kind"] for d in docs] == ["Service", "Secret", "Pod", "Pod"]
    assert docs[2]["metadata"]["name"] == "gpt-1-0" and "stringData" not in docs[1]  # no token: drawn at creation


def test_render_names_the_field_of_a_bad_spec(tmp_path):
    from kubetron.contract.errors import ConfigError

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_body(S3_JOB, config="train:\n  train_iters: -5\n")))
    with pytest.raises(ConfigError, match=r"job.yaml: spec.config: train.train_iters: must be >= 1"):
        render_file(str(path))


def test_pods_snapshot_into_a_memory_volume_of_kubetron_plans_size_and_copy_to_peers_with_the_jobs_token():
    """docs/recovery.md: a memory-backed emptyDir sized from the plan's estimate (2 snapshots of the rank and
    2 of the previous pod's rank, 10 % headroom, at least 64 MiB), its path, size and the replication in the
    environment; the agents' address (downward API) and the token from the job's Secret, never a literal."""
    job = Job.from_body(job_body(PVC_JOB, nodes=3, memorySnapshots={"replicationFactor": 3, "replicationJump": 1}))
    manifests = build(job, 1)
    (secret,) = by_kind(manifests, "Secret")
    assert secret["metadata"]["name"] == "gpt-peers" and secret["metadata"]["ownerReferences"][0]["uid"] == "uid-123"
    token = with_token(secret)["stringData"]["token"]
    assert len(token) >= 40 and with_token(secret)["stringData"]["token"] != token  # drawn at creation, random
    pod = by_kind(manifests, "Pod")[1]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "snapshots"]
    per_rank = job.spec.snapshot_bytes
    assert per_rank > 0 and volume["emptyDir"] == {
        "medium": "Memory", "sizeLimit": str(max(64 << 20, math.ceil(2 * 3 * per_rank * 1.1)))}
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "snapshots"]
    env = env_of(pod)
    assert env["KUBETRON_SNAPSHOT_DIR"]["value"] == mount["mountPath"]
    assert env["KUBETRON_SNAPSHOT_LIMIT_BYTES"]["value"] == volume["emptyDir"]["sizeLimit"]
    assert (env["KUBETRON_REPLICATION_FACTOR"]["value"], env["KUBETRON_REPLICATION_JUMP"]["value"]) == ("3", "1")
    assert env["KUBETRON_POD_IP"] == {"name": "KUBETRON_POD_IP",
                                      "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert env["KUBETRON_PEER_TOKEN"] == {"name": "KUBETRON_PEER_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "gpt-peers", "key": "token"}}}
    # The token's Secret is the job's (job_objects, created once a pod is placed, not with each attempt); the pods
    # mount it read-only, so a kubelet waits for it before it starts the trainer (it retries a volume within a second,
    # a variable from a missing Secret only every 10 s or more).
    assert not by_kind(attempt_objects(job, 1), "Secret") and by_kind(job_objects(job), "Secret") == [secret]
    (peers,) = [v for v in pod["spec"]["volumes"] if v["name"] == "peers"]
    assert peers == {"name": "peers", "secret": {"secretName": "gpt-peers", "defaultMode": 0o440}}
    assert {"name": "peers", "mountPath": "/var/run/kubetron/peers", "readOnly": True} in pod["spec"]["containers"][0][
        "volumeMounts"]
    # off: no volume, no Secret, no variables; one pod: its own snapshots, no copies (no token, no address)
    off = build(Job.from_body(job_body(PVC_JOB, memorySnapshots={"enabled": False})), 1)
    assert not by_kind(off, "Secret") and not any(v["name"] == "snapshots" for v in by_kind(off, "Pod")[0]["spec"][
        "volumes"]) and not [k for k in env_of(by_kind(off, "Pod")[0]) if "SNAPSHOT" in k or "PEER" in k]
    single = build(Job.from_body(job_body(PVC_JOB, nodes=1)), 1)
    assert not by_kind(single, "Secret") and "KUBETRON_SNAPSHOT_DIR" in env_of(by_kind(single, "Pod")[0])
    assert "KUBETRON_PEER_TOKEN" not in env_of(by_kind(single, "Pod")[0])
    assert not [v for v in by_kind(single, "Pod")[0]["spec"]["volumes"] if "secret" in v]


@pytest.mark.parametrize("limit, refused", [("1Gi", False), ("20Mi", True), (None, False)])
def test_a_pod_too_small_for_its_snapshots_is_refused_before_it_starts(limit, refused):
    """The plan's estimate against the pod's memory limit (docs/recovery.md): a job whose pods cannot hold the
    volume and the host copies is Failed (InsufficientMemory) at admission, never created to be OOM-killed."""
    body = job_body(PVC_JOB, resources={"limits": {"memory": limit}} if limit else {})
    if not refused:
        Job.from_body(body)
        return
    with pytest.raises(SpecError, match=r"spec.memorySnapshots: the pods' memory limit \(20Mi\) cannot hold their "
                                        r"snapshots in memory: 64.0 MiB for the memory volume .* or set "
                                        r"spec.memorySnapshots.enabled: false"):
        Job.from_body(body)
    Job.from_body(job_body(body, memorySnapshots={"enabled": False}))  # off: nothing to hold


@pytest.mark.parametrize("text, expected", [("1Gi", 1 << 30), ("500M", 500_000_000), ("1e9", 10**9), (1024, 1024),
                                            ("0.5Ki", 512), ("12x", None), ("-1", None), ("", None)])
def test_memory_quantities_read_as_kubernetes_writes_them(text, expected):
    assert recovery.parse_quantity(text) == expected
