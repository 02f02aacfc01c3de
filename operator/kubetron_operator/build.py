"""build(job, attempt) -> manifests: everything one attempt of a TrainingJob runs as. Pure: no API calls.

Per job (job_objects): a headless Service (stable DNS for rank 0, the rendezvous host) and, with copies of the
memory snapshots on peers, the Secret of the job's peer token; both created once a pod of the job is placed on
a node (a job waiting in a queue or for room costs neither, nor the Endpoints and EndpointSlice the control
plane keeps for a Service; the pods mount the token's Secret, so a kubelet starts none before it exists).
Per attempt: an optional
PodGroup for gang scheduling (Kubernetes' v1beta1 one is per job, its minCount resized: docs/gang.md) and one
pod per node named `<job>-<attempt>-<rank>`. Each pod carries the
trainer's config itself (an annotation the kubelet writes to /etc/kubetron/config.yaml through a
downward API volume): a start costs no ConfigMap to create and, when the attempt ends, to delete.
Every child carries the job's labels and a controller owner reference, so the garbage collector
removes it with the job and a restarted operator finds it by label.
"""

from __future__ import annotations

from typing import Any

from kubetron.contract import recovery
from kubetron.contract.hang import TIMEOUT_ENV as HANG_TIMEOUT_ENV
from kubetron.contract.resource import API_VERSION, KIND, LABEL_ATTEMPT, LABEL_JOB, LABEL_RANK, LABEL_ROLE, TRAINER
from kubetron.contract.termination import DEFAULT_TERMINATION_LOG

from kubetron_operator.model import (
    CONFIG_ANNOTATION,
    COSCHEDULING_GROUP_LABEL,
    KUEUE_COUNT_ANNOTATION,
    KUEUE_GROUP_LABEL,
    PEER_TOKEN_MOUNT,
    POD_GROUP_APIS,
    QUEUE_LABEL,
    RESIZABLE_POD_GROUP_APIS,
    S3_SECRET_KEYS,
    VOLCANO_GROUP_ANNOTATION,
    Job,
    PvcStorage,
    S3Storage,
)

MANAGED_BY = {"app.kubernetes.io/managed-by": "kubetron"}

CONFIG_DIR = "/etc/kubetron"
CONFIG_PATH = f"{CONFIG_DIR}/config.yaml"
TERMINATION_LOG = DEFAULT_TERMINATION_LOG  # the path Kubernetes reads the trainer's message from
RUN_AS_USER = 10001  # the images (Dockerfile) and the chart run as this UID
PYTHON = "python3"  # what the trainer image's ENTRYPOINT runs; every Python image has it, not all have `python`
DEFAULT_COSCHEDULER = "scheduler-plugins-scheduler"
HOSTNAME_LABEL = "kubernetes.io/hostname"


# -- names (deterministic: a restarted operator computes the same ones) ------------------------------


def pod_name(job: Job, attempt: int, rank: int) -> str:
    return f"{job.name}-{attempt}-{rank}"


def service_name(job: Job) -> str:
    return job.name


def pod_group_name(job: Job, attempt: int, api_version: str | None = None) -> str:
    """`<job>-<attempt>`; the job's name for a PodGroup whose minCount is resized (RESIZABLE_POD_GROUP_APIS)."""
    return job.name if api_version in RESIZABLE_POD_GROUP_APIS else f"{job.name}-{attempt}"


def gang_api(job: Job, served: str | None = None) -> str:
    """The PodGroup apiVersion of the job's gang: `served` (what the API server serves, api_calls.Kube.pod_group_api),
    else its oldest (the scheduler's CRD's; Kubernetes' own: 1.36's v1alpha2)."""
    return served or POD_GROUP_APIS[job.spec.scheduling.gang][-1]


def peer_secret_name(job: Job) -> str:
    """The job's token for the copies of its snapshots on its pods (docs/recovery.md)."""
    return f"{job.name}-peers"


def probe_pod_name(job: Job, attempt: int, rank: int) -> str:
    """A placeholder for the missing rank `rank` while attempt `attempt` runs on fewer nodes (docs/elastic.md)."""
    return f"{job.name}-{attempt}-probe-{rank}"


def master_addr(job: Job, attempt: int) -> str:
    """Rank 0's DNS name through the headless Service (pod hostname + subdomain)."""
    return f"{pod_name(job, attempt, 0)}.{service_name(job)}.{job.namespace}.svc"


# -- the manifests ------------------------------------------------------------------------------------


def build(job: Job, attempt: int, expected_iteration: int = 0,
          avoid_nodes: tuple[str, ...] = (), nodes: int = 0, pod_group_api: str | None = None) -> list[dict[str, Any]]:
    """All objects of attempt `attempt`: job_objects(), then attempt_objects()."""
    return [*job_objects(job), *attempt_objects(job, attempt, expected_iteration, avoid_nodes, nodes, pod_group_api)]


def job_objects(job: Job) -> list[dict[str, Any]]:
    """The objects every attempt of the job shares, in creation order: the headless Service, then the peer token's
    Secret (when its pods copy their snapshots to each other). The operator creates them only once a pod of the job
    is placed on a node (policy.start.needs_job_objects): until then nothing reads them."""
    return [build_service(job), *([build_peer_secret(job)] if job.spec.peer_copies else [])]


def attempt_objects(job: Job, attempt: int, expected_iteration: int = 0,
                    avoid_nodes: tuple[str, ...] = (), nodes: int = 0,
                    pod_group_api: str | None = None) -> list[dict[str, Any]]:
    """The objects of attempt `attempt` itself, in creation order (PodGroup, pods).

    `nodes` is the attempt's size (0: spec.nodes); an elastic job's attempt may be smaller (docs/elastic.md).
    `expected_iteration` is the last durable checkpoint the operator knows of; the pods pass it to the
    trainer (KUBETRON_EXPECTED_ITERATION), which fails loudly if the store holds less. `avoid_nodes` are
    nodes that rejected or lost an earlier attempt: the pods get a node anti-affinity to them.
    `pod_group_api`: the PodGroup version the cluster serves for the job's gang (gang_api()).
    """
    nodes = nodes or job.spec.nodes
    manifests: list[dict[str, Any]] = []
    if job.spec.scheduling.gang != "none":
        manifests.append(build_pod_group(job, attempt, nodes, pod_group_api))
    manifests += [build_pod(job, attempt, rank, expected_iteration, avoid_nodes, nodes, pod_group_api)
                  for rank in range(nodes)]
    return manifests


def owner_reference(job: Job) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": KIND, "name": job.name, "uid": job.uid,
        "controller": True, "blockOwnerDeletion": True,
    }


def _metadata(job: Job, name: str, attempt: int | None = None, **labels: str) -> dict[str, Any]:
    all_labels = {**MANAGED_BY, LABEL_JOB: job.name}
    if attempt is not None:
        all_labels[LABEL_ATTEMPT] = str(attempt)
    all_labels.update(labels)
    return {"name": name, "namespace": job.namespace, "labels": all_labels,
            "ownerReferences": [owner_reference(job)]}


def build_service(job: Job) -> dict[str, Any]:
    """Headless; publishes not-ready pods so rank 0's name resolves while the gang is still starting."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(job, service_name(job)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job.name, LABEL_ROLE: "worker"},
            "ports": [{"name": "rendezvous", "port": job.spec.master_port, "targetPort": job.spec.master_port}],
        },
    }


def build_peer_secret(job: Job) -> dict[str, Any]:
    """The Secret of the job's token, which its pods' agents require of each other for every copy
    (kubetron.supervisor.peers); its value is drawn when it is created (apply.with_token), once: an existing Secret of
    this job is kept. Never logged, never in status."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _metadata(job, peer_secret_name(job))}


def build_pod_group(job: Job, attempt: int, nodes: int = 0, served: str | None = None) -> dict[str, Any]:
    """Volcano, scheduler-plugins or Kubernetes PodGroup: schedule all the attempt's `nodes` pods or none.
    Kubernetes' own (KEP-4671): v1alpha2's minCount is immutable, so one PodGroup per attempt; v1beta1's is
    mutable, so one per job (no attempt label), resized to each attempt (pod_group_resize), and disrupted as one
    (disruptionMode `all`, a struct in v1beta1: the scheduler preempts the whole gang or none of it, as losing
    one pod ends the attempt anyway)."""
    api_version = gang_api(job, served)
    per_attempt = api_version not in RESIZABLE_POD_GROUP_APIS
    spec: dict[str, Any] = {"minMember": nodes or job.spec.nodes}
    if job.spec.scheduling.gang == "kubernetes":
        spec = {"schedulingPolicy": {"gang": {"minCount": spec["minMember"]}}}
        if not per_attempt:
            spec["disruptionMode"] = {"all": {}}
    elif job.spec.scheduling.gang == "volcano" and job.spec.scheduling.priority_class_name:
        spec["priorityClassName"] = job.spec.scheduling.priority_class_name
    return {"apiVersion": api_version, "kind": "PodGroup",
            "metadata": _metadata(job, pod_group_name(job, attempt, api_version), attempt if per_attempt else None),
            "spec": spec}


def pod_group_resize(group: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that gives an existing resizable PodGroup the minCount of `group` (build_pod_group)."""
    return {"spec": {"schedulingPolicy": {"gang": {"minCount": group["spec"]["schedulingPolicy"]["gang"]["minCount"]}}}}


def rank_env(job: Job, attempt: int, rank: int, expected_iteration: int = 0, nodes: int = 0) -> list[dict[str, Any]]:
    """The container environment of one rank of an attempt of `nodes` pods (0: spec.nodes), as Kubernetes
    EnvVars (secrets as secretKeyRef)."""
    spec = job.spec
    nodes = nodes or spec.nodes
    plain = {
        "KUBETRON_JOB_ID": f"{job.namespace}/{job.name}/{attempt}",
        "KUBETRON_EXPECTED_ITERATION": str(expected_iteration),
        "KUBETRON_TERMINATION_LOG": TERMINATION_LOG,
        "KUBETRON_STATUS_PORT": str(spec.status_port if rank == 0 else 0),
        "KUBETRON_CONFIG": CONFIG_PATH,
        "MASTER_ADDR": master_addr(job, attempt),
        "MASTER_PORT": str(spec.master_port),
        "WORLD_SIZE": str(nodes * spec.nproc_per_node),
        "RANK": str(rank * spec.nproc_per_node),
        "NNODES": str(nodes),
        "NODE_RANK": str(rank),
        "NPROC_PER_NODE": str(spec.nproc_per_node),
        "KUBETRON_MAX_IN_PLACE_RESTARTS": str(spec.max_in_place_restarts),
    }
    if spec.hang_timeout_seconds is not None:  # else the trainer's default rule (docs/recovery.md)
        plain[HANG_TIMEOUT_ENV] = str(spec.hang_timeout_seconds)
    plain.update(_snapshot_env(job))
    env: list[dict[str, Any]] = [dict(var) for var in spec.env]  # user's first; ours cannot be overridden
    env += [{"name": k, "value": v} for k, v in plain.items()]
    if spec.peer_copies:  # the agents' address and the job's token (docs/recovery.md)
        env += [{"name": recovery.POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": recovery.PEER_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                    "name": peer_secret_name(job), "key": recovery.PEER_TOKEN_KEY}}}]
    storage = spec.storage
    if isinstance(storage, S3Storage):
        # Without a secretRef the pods' ServiceAccount gives them credentials (IRSA, workload identity).
        for key in S3_SECRET_KEYS if storage.secret_name else ():
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": storage.secret_name, "key": key}}})
        if storage.endpoint:
            env.append({"name": "AWS_ENDPOINT_URL", "value": storage.endpoint})
        if storage.region:
            env.append({"name": "AWS_REGION", "value": storage.region})
    return env


def _snapshot_env(job: Job) -> dict[str, str]:
    """The memory volume the trainer snapshots into and its agent's copies go to (none when snapshots are off)."""
    spec = job.spec
    if not spec.snapshot_volume:
        return {}
    return {recovery.SNAPSHOT_DIR_ENV: recovery.SNAPSHOT_MOUNT, recovery.SNAPSHOT_LIMIT_ENV: str(spec.snapshot_volume),
            recovery.REPLICATION_FACTOR_ENV: str(spec.memory_snapshots.factor),
            recovery.REPLICATION_JUMP_ENV: str(spec.memory_snapshots.jump)}


def _snapshot_volume(job: Job) -> tuple[list[dict], list[dict]]:
    """A memory-backed emptyDir of kubetron plan's size for the snapshots (its use counts in the pod's memory), and
    with copies on peers the peer token's Secret, mounted read-only: a kubelet sets up every mounted volume before
    it starts a container and retries one whose Secret does not exist yet (within a second at first), so a pod
    placed before the operator created the token waits for it, instead of failing to read its KUBETRON_PEER_TOKEN
    variable (CreateContainerConfigError, retried only every 10 s or more)."""
    if not job.spec.snapshot_volume:
        return [], []
    volumes: list[dict[str, Any]] = [
        {"name": "snapshots", "emptyDir": {"medium": "Memory", "sizeLimit": str(job.spec.snapshot_volume)}}]
    mounts: list[dict[str, Any]] = [{"name": "snapshots", "mountPath": recovery.SNAPSHOT_MOUNT}]
    if job.spec.peer_copies:
        volumes.append({"name": "peers", "secret": {"secretName": peer_secret_name(job), "defaultMode": 0o440}})
        mounts.append({"name": "peers", "mountPath": PEER_TOKEN_MOUNT, "readOnly": True})
    return volumes, mounts


def trainer_args(job: Job) -> list[str]:
    """Arguments after `python -m kubetron.launch`, as the trainer receives them: the trainer command line
    with the store overrides (the pod carries them kubelet_escaped).

    The store overrides come last, so nothing before them can point the trainer away from the store.
    """
    command = "train" if job.spec.mode == "pretrain" else "finetune"
    return [command, "--config", CONFIG_PATH, *job.spec.overrides,
            f"checkpoint.save={job.store}", f"checkpoint.load={job.store}"]


def kubelet_escaped(arg: str) -> str:
    """`arg` as a container's args must carry it so the process receives it as written: the kubelet expands
    `$(VAR)` from the container's environment and turns `$$` into `$` (after the operator checked the
    literal), so every `$` is doubled."""
    return arg.replace("$", "$$")


def rank_command(job: Job, attempt: int, rank: int, expected_iteration: int = 0,
                 nodes: int = 0) -> tuple[list[str], dict[str, str]]:
    """(argv, plain env) of one rank's container, for running a pod's process locally in tests.

    Secret-backed variables are left out (the caller supplies credentials its own way).
    """
    argv = [PYTHON, "-m", "kubetron.launch", *trainer_args(job)]
    env = {v["name"]: v["value"] for v in rank_env(job, attempt, rank, expected_iteration, nodes) if "value" in v}
    return argv, env


def _security_context_pod() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _security_context_container() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True}


def _resources(job: Job) -> dict[str, Any]:
    res = {k: dict(v) for k, v in job.spec.resources.items() if k in ("requests", "limits") and v}
    if job.spec.gpus_per_node:
        res.setdefault("limits", {})["nvidia.com/gpu"] = job.spec.gpus_per_node
    return res


def _storage_volume(job: Job) -> tuple[list[dict], list[dict]]:
    storage = job.spec.storage
    if not isinstance(storage, PvcStorage):
        return [], []
    return ([{"name": "store", "persistentVolumeClaim": {"claimName": storage.claim_name}}],
            [{"name": "store", "mountPath": storage.mount_path}])


def _avoid(affinity: dict[str, Any], nodes: tuple[str, ...]) -> dict[str, Any]:
    """`affinity` plus `kubernetes.io/hostname NotIn nodes` in every required node selector term (terms are ORed)."""
    if not nodes:
        return affinity
    rule = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(nodes)}
    node_aff = dict(affinity.get("nodeAffinity") or {})
    required = dict(node_aff.get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = [dict(t) for t in required.get("nodeSelectorTerms") or ()] or [{}]
    for term in terms:
        term["matchExpressions"] = [*(term.get("matchExpressions") or ()), rule]
    required["nodeSelectorTerms"] = terms
    node_aff["requiredDuringSchedulingIgnoredDuringExecution"] = required
    return {**affinity, "nodeAffinity": node_aff}


def _apply_scheduling(job: Job, pod_spec: dict[str, Any], metadata: dict[str, Any], attempt: int,
                      avoid_nodes: tuple[str, ...] = (), pod_group_api: str | None = None) -> None:
    sched = job.spec.scheduling
    scheduler = sched.scheduler_name or {"volcano": "volcano", "coscheduling": DEFAULT_COSCHEDULER}.get(sched.gang)
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in sched.tolerations]
    affinity = _avoid(dict(sched.affinity), avoid_nodes)
    if affinity:
        pod_spec["affinity"] = affinity
    if sched.gang == "volcano":
        metadata.setdefault("annotations", {})[VOLCANO_GROUP_ANNOTATION] = pod_group_name(job, attempt)
    elif sched.gang == "coscheduling":
        metadata["labels"][COSCHEDULING_GROUP_LABEL] = pod_group_name(job, attempt)
    elif sched.gang == "kubernetes":
        pod_spec["schedulingGroup"] = {"podGroupName": pod_group_name(job, attempt, gang_api(job, pod_group_api))}


def build_pod(job: Job, attempt: int, rank: int, expected_iteration: int = 0,
              avoid_nodes: tuple[str, ...] = (), nodes: int = 0, pod_group_api: str | None = None) -> dict[str, Any]:
    spec = job.spec
    volumes, mounts = _storage_volume(job)
    memory_volumes, memory_mounts = _snapshot_volume(job)
    volumes, mounts = volumes + memory_volumes, mounts + memory_mounts
    config_file = {"path": "config.yaml", "fieldRef": {"fieldPath": f"metadata.annotations['{CONFIG_ANNOTATION}']"}}
    volumes += [{"name": "config", "downwardAPI": {"items": [config_file]}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts += [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
               {"name": "dshm", "mountPath": "/dev/shm"}]
    container: dict[str, Any] = {
        "name": TRAINER,
        "image": spec.image,
        "command": [PYTHON, "-m", "kubetron.launch"],
        "args": [kubelet_escaped(arg) for arg in trainer_args(job)],
        "env": rank_env(job, attempt, rank, expected_iteration, nodes),
        "resources": _resources(job),
        "volumeMounts": mounts,
        "ports": [{"name": "rendezvous", "containerPort": spec.master_port}],
        "securityContext": _security_context_container(),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if rank == 0 and spec.status_port:
        container["ports"].append({"name": "status", "containerPort": spec.status_port})
    metadata = _metadata(job, pod_name(job, attempt, rank), attempt,
                         **{LABEL_RANK: str(rank), LABEL_ROLE: "worker"})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the operator restarts the whole gang, from the last checkpoint
        "hostname": pod_name(job, attempt, rank),
        "subdomain": service_name(job),
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": _security_context_pod(),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    _apply_template(job, pod_spec, container, metadata)
    metadata.setdefault("annotations", {})[CONFIG_ANNOTATION] = spec.config
    _apply_scheduling(job, pod_spec, metadata, attempt, avoid_nodes, pod_group_api)
    _apply_queue(job, metadata, pod_group_name(job, attempt), nodes or spec.nodes)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


PROBE_COMMAND = [PYTHON, "-c", "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
                 "signal.pause()"]
"""A probe's container: sleeps until SIGTERM, then exits at once (PID 1 has no default SIGTERM action)."""


def build_probe_pod(job: Job, attempt: int, rank: int, nodes: int) -> dict[str, Any]:
    """A placeholder for missing rank `rank` while attempt `attempt` runs on `nodes` < spec.nodes pods: the
    rank's own pod (requests, limits, affinity, tolerations, volumes, scheduler, priority) with the trainer
    replaced by a sleep and no init containers or sidecars, so the real kube-scheduler judges whether the
    full gang fits again. Role `probe`: never a rank, never behind the Service. Its own Kueue pod group
    (the missing members), so Kueue admits probes only where quota for them is free; no gang PodGroup."""
    pod = build_pod(job, attempt, rank)
    meta, spec = pod["metadata"], pod["spec"]
    meta["name"] = probe_pod_name(job, attempt, rank)
    meta["labels"][LABEL_ROLE] = "probe"
    for key in (COSCHEDULING_GROUP_LABEL, KUEUE_GROUP_LABEL):
        meta["labels"].pop(key, None)
    meta.get("annotations", {}).pop(VOLCANO_GROUP_ANNOTATION, None)
    meta.get("annotations", {}).pop(KUEUE_COUNT_ANNOTATION, None)
    meta["annotations"].pop(CONFIG_ANNOTATION)  # the trainer's config: not needed
    trainer = spec["containers"][0]
    spec["containers"] = [{"name": "probe", "image": trainer["image"], "command": list(PROBE_COMMAND),
                           "resources": trainer["resources"], "securityContext": trainer["securityContext"],
                           **({"imagePullPolicy": trainer["imagePullPolicy"]} if "imagePullPolicy" in trainer
                              else {})}]
    for key in ("initContainers", "hostname", "subdomain", "schedulingGroup"):
        spec.pop(key, None)
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "config"]
    spec["terminationGracePeriodSeconds"] = 5
    _apply_queue(job, meta, f"{pod_group_name(job, attempt)}-probes", job.spec.nodes - nodes)
    return pod


def _apply_template(job: Job, pod_spec: dict[str, Any], container: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Merge spec.podTemplate. Why additive only: model.parse_pod_template already rejected anything that
    would replace one of the operator's own fields, so here the template only adds."""
    t = job.spec.pod_template
    metadata["labels"] = {**t.labels, **metadata["labels"]}
    if t.annotations:
        metadata["annotations"] = {**t.annotations, **(metadata.get("annotations") or {})}
    if t.env:
        container["env"] = [dict(v) for v in t.env] + container["env"]  # ours last: they win in Kubernetes
    if t.env_from:
        container["envFrom"] = [dict(v) for v in t.env_from]
    container["volumeMounts"] += [dict(m) for m in t.volume_mounts]
    if t.capabilities:
        container["securityContext"]["capabilities"]["add"] = list(t.capabilities)
    pod_spec["volumes"] += [dict(v) for v in t.volumes]
    if t.init_containers:
        pod_spec["initContainers"] = [dict(c) for c in t.init_containers]
    pod_spec["containers"] += [dict(c) for c in t.sidecars]
    if t.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # rank 0's Service name must still resolve


def _apply_queue(job: Job, metadata: dict[str, Any], group: str, count: int) -> None:
    """Kueue plain pod groups: one group per attempt (each attempt is admitted, and counted, anew), of the
    attempt's size; an elastic job's probes form a group of their own."""
    if not job.spec.queue_name:
        return
    metadata["labels"][QUEUE_LABEL] = job.spec.queue_name
    metadata["labels"][KUEUE_GROUP_LABEL] = group
    metadata.setdefault("annotations", {})[KUEUE_COUNT_ANNOTATION] = str(count)
