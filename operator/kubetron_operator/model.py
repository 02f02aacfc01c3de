"""The TrainingJob as frozen dataclasses: parsed once from the API body, then passed to build()/decide().

Defaults here match the CRD's (crds/trainingjob.yaml), so a body that skipped server-side defaulting
(`kubetron render` on a local file) means the same as one read back from the API server.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import yaml
from kubetron.contract import recovery
from kubetron.contract.config import ConfigContainer, apply_overrides
from kubetron.contract.errors import ConfigError
from kubetron.contract.plan import snapshot_bytes
from kubetron.contract.resource import TRAINER

MAX_NAME = 45
"""Longest job name: `<job>-<attempt>-<rank>` is a pod hostname (a DNS label, at most 63 characters)."""

RESERVED_ENV = frozenset({
    "KUBETRON_JOB_ID", "KUBETRON_EXPECTED_ITERATION", "KUBETRON_TERMINATION_LOG", "KUBETRON_STATUS_PORT",
    "KUBETRON_CONFIG", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NNODES", "NODE_RANK",
    "NPROC_PER_NODE", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
    "KUBETRON_MAX_IN_PLACE_RESTARTS", *recovery.POD_ENV,
})
"""Variables the operator sets itself (docs/CONTRACT.md); a spec.env entry may not override them."""

S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
"""The keys of a job's storage.s3.secretRef Secret: the pods' credentials and the operator's."""

STORE_KEYS = ("checkpoint.save", "checkpoint.load")
"""Config keys the operator sets to the job's store; a spec.overrides entry may not redirect them."""

GPU = "nvidia.com/gpu"

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Kueue's queue label: on the TrainingJob it means spec.queueName; on the pods it is what Kueue reads."""
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
"""Set to "false" on an ended attempt's pods: Kueue then finishes the group's Workload (its quota is freed)."""
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
POD_GROUP_APIS: dict[str, tuple[str, ...]] = {
    "volcano": ("scheduling.volcano.sh/v1beta1",), "coscheduling": ("scheduling.x-k8s.io/v1alpha1",),
    "kubernetes": ("scheduling.k8s.io/v1beta1", "scheduling.k8s.io/v1alpha2")}
"""spec.scheduling.gang -> the PodGroup apiVersions it may use, preferred first: one is the scheduler's CRD, asked
for as it is; of several, the first the API server serves (api_calls.Kube.pod_group_api; docs/gang.md)."""
RESIZABLE_POD_GROUP_APIS = frozenset({"scheduling.k8s.io/v1beta1"})
"""PodGroup versions whose minCount may change: one PodGroup per job, resized to each attempt (build.py)."""

RESERVED_LABEL_PREFIXES = ("kubetron.dev/",)
RESERVED_LABELS = frozenset({"app.kubernetes.io/managed-by", COSCHEDULING_GROUP_LABEL, QUEUE_LABEL, KUEUE_GROUP_LABEL})
CONFIG_ANNOTATION = "kubetron.dev/config"  # spec.config on each worker pod (build.py: its config.yaml file)
# Kubernetes allows 256 KiB of annotations per object in all; the rest is left to the pod template's own.
CONFIG_LIMIT = 192 * 1024
RESERVED_ANNOTATIONS = frozenset({VOLCANO_GROUP_ANNOTATION, KUEUE_COUNT_ANNOTATION, KUEUE_RETRIABLE_ANNOTATION,
                                  CONFIG_ANNOTATION})
"""Pod labels/annotations the operator sets (identity, Kueue, gang scheduling): spec.podTemplate may not set them.
Only the exact Kueue keys the operator writes: users' other Kueue requests (`kueue.x-k8s.io/podset-required-topology`,
`podset-preferred-topology`, ...) pass through to every pod."""

RESERVED_VOLUMES = frozenset({"store", "config", "dshm", "snapshots", "peers"})
PEER_TOKEN_MOUNT = "/var/run/kubetron/peers"  # the peer token's Secret, mounted so a kubelet waits for it (build.py)
RESERVED_CONTAINERS = frozenset({"progress"})
TEMPLATE_SPEC_KEYS = ("hostNetwork", "volumes", "initContainers", "containers")
TRAINER_KEYS = ("name", "env", "envFrom", "volumeMounts", "securityContext")

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""A Kubernetes object name (a DNS-1123 subdomain): the CRD's pattern for every name a spec carries."""
NAME_MAX = 253
_NAME = re.compile(NAME_PATTERN)
BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
"""An S3 bucket name (3-63 lowercase letters, digits, '.', '-')."""
_BUCKET = re.compile(BUCKET_PATTERN)
ENDPOINT_PATTERN = r"^(https?://[^\s/?#@]+/?)?$"
"""spec.storage.s3.endpoint: empty (AWS) or an http(s) URL naming only a host (and port)."""
_ENDPOINT = re.compile(ENDPOINT_PATTERN)
_REGION = re.compile(r"[a-z0-9-]{0,32}")  # spec.storage.s3.region: it is part of AWS S3's host name

POD_OVERHEAD = 8 * 1024
"""Bytes of each worker pod that are the operator's own fields (about 4 KiB; counted generously)."""
ATTEMPT_LIMIT = 64 * 1024 * 1024
"""Bytes of pods one attempt may make the operator create: spec.config, spec.podTemplate, spec.env and
spec.overrides are copied onto every pod (the API server, etcd and the operator each hold them)."""


class SpecError(ValueError):
    """A TrainingJob spec the operator cannot run: `field` is the dotted path at fault.

    The job fails as ConfigError when the field is spec.config or spec.overrides, else as InvalidSpec.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class S3Storage:
    bucket: str
    secret_name: str = ""  # "": no secretRef, the pods' ServiceAccount gives them credentials (IRSA ...)
    prefix: str = ""
    endpoint: str = ""
    region: str = ""


@dataclass(frozen=True)
class PvcStorage:
    claim_name: str
    mount_path: str = "/ckpt"
    sub_path: str = ""


@dataclass(frozen=True)
class Scheduling:
    scheduler_name: str = ""
    priority_class_name: str = ""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    gang: str = "none"  # none | volcano | coscheduling | kubernetes


@dataclass(frozen=True)
class PodTemplate:
    """spec.podTemplate: what is merged into every worker pod (docs/pod-template.md)."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    host_network: bool = False
    volumes: tuple[Mapping[str, Any], ...] = ()
    init_containers: tuple[Mapping[str, Any], ...] = ()
    sidecars: tuple[Mapping[str, Any], ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()  # the trainer container's
    env_from: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    capabilities: tuple[str, ...] = ()  # securityContext.capabilities.add of the trainer container


@dataclass(frozen=True)
class MemorySnapshots:
    """spec.memorySnapshots (docs/recovery.md): every rank's newest state in a memory volume of its pod, and a copy
    on `factor` - 1 other pods (`jump` apart)."""

    enabled: bool = True
    factor: int = recovery.DEFAULT_FACTOR
    jump: int = recovery.DEFAULT_JUMP


@dataclass(frozen=True)
class JobSpec:
    image: str
    nodes: int
    config: str
    storage: S3Storage | PvcStorage
    gpus_per_node: int = 0
    resources: Mapping[str, Any] = field(default_factory=dict)
    mode: str = "pretrain"  # pretrain | finetune
    overrides: tuple[str, ...] = ()
    backoff_limit: int = 3
    max_no_progress_attempts: int = 3
    suspend: bool = False
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    termination_grace_period_seconds: int = 120
    startup_timeout_seconds: int = 600
    max_never_started_attempts: int = 5
    max_in_place_restarts: int = 3
    hang_timeout_seconds: int | None = None  # None: the trainer's default rule; 0: off (docs/recovery.md)
    min_nodes: int = 0  # spec.minNodes as asked (0: as nodes); `sizes` holds what admission found works
    shrink_after_seconds: int = 60  # an attempt's pods Unschedulable this long -> the next attempt is smaller
    sizes: tuple[int, ...] = ()  # node counts an attempt may have, ascending, `nodes` last (admission fills it)
    min_nodes_note: str = ""  # why the smallest size is above spec.minNodes (admission rounded it up)
    status_port: int = 8080
    master_port: int = 29500
    env: tuple[Mapping[str, Any], ...] = ()
    scheduling: Scheduling = field(default_factory=Scheduling)
    image_pull_policy: str = ""
    image_pull_secrets: tuple[str, ...] = ()
    service_account_name: str = ""
    queue_name: str = ""  # Kueue LocalQueue (spec.queueName or the job's kueue.x-k8s.io/queue-name label)
    pod_template: PodTemplate = field(default_factory=PodTemplate)
    memory_snapshots: MemorySnapshots = field(default_factory=MemorySnapshots)
    snapshot_bytes: float = 0.0  # one rank's snapshot, by kubetron plan's estimate (admission fills it)

    @property
    def snapshot_volume(self) -> int:
        """Bytes of each pod's memory volume for the snapshots and their copies (0: snapshots off)."""
        m = self.memory_snapshots
        if not m.enabled:
            return 0
        return recovery.volume_bytes(self.snapshot_bytes, self.nproc_per_node, self.nodes, m.factor, m.jump)

    @property
    def peer_copies(self) -> bool:
        """Pods hold copies of each other's snapshots (snapshots on, a copy asked for, more than one pod)."""
        return self.snapshot_volume > 0 and self.memory_snapshots.factor > 1 and self.nodes > 1

    @property
    def nproc_per_node(self) -> int:
        """Trainer processes per pod: one per GPU, or one on a CPU node."""
        return self.gpus_per_node or 1

    @property
    def elastic(self) -> bool:
        """Attempts may run on fewer than `nodes` pods (docs/elastic.md)."""
        return len(self.sizes) > 1


@dataclass(frozen=True)
class Job:
    """One TrainingJob: identity (for names and owner references) plus its spec."""

    name: str
    namespace: str
    uid: str
    spec: JobSpec

    @property
    def store(self) -> str:
        """The checkpoint store URI the trainer saves to and resumes from (one per job)."""
        storage = self.spec.storage
        if isinstance(storage, S3Storage):
            parts = [p.strip("/") for p in (storage.prefix, self.namespace, self.name) if p.strip("/")]
            return f"s3://{storage.bucket}/" + "/".join(parts)
        sub = storage.sub_path.strip("/") or self.name
        return f"{storage.mount_path.rstrip('/')}/{sub}"

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Job:
        """Parse a TrainingJob (as the API serves it, or as a user wrote it) or raise SpecError."""
        meta = body.get("metadata") or {}
        name = meta.get("name") or ""
        if not _DNS_LABEL.match(name) or len(name) > MAX_NAME:
            raise SpecError("metadata.name", f"must be a DNS label of at most {MAX_NAME} characters, got {name!r}")
        spec = parse_spec(body.get("spec") or {})
        label_queue = (meta.get("labels") or {}).get(QUEUE_LABEL) or ""
        if label_queue and spec.queue_name and label_queue != spec.queue_name:
            raise SpecError("spec.queueName", f"{spec.queue_name!r} disagrees with the job's label "
                            f"{QUEUE_LABEL}={label_queue!r}; set one of them")
        if label_queue and not spec.queue_name:
            spec = replace(spec, queue_name=label_queue)
        job = cls(name=name, namespace=meta.get("namespace") or "default", uid=meta.get("uid") or "", spec=spec)
        spec = job.spec
        check_trainer_config(spec.config, spec.overrides, job.store, spec.nodes * spec.nproc_per_node,
                             spec.gpus_per_node > 0)
        sizes, note = elastic_sizes(spec, job.store)
        spec = replace(spec, sizes=sizes, min_nodes_note=note, snapshot_bytes=_snapshot_bytes(
            spec.config, spec.overrides, job.store, spec.nodes * spec.nproc_per_node, spec.gpus_per_node > 0))
        check_snapshot_memory(spec)
        return replace(job, spec=spec)


@functools.lru_cache(maxsize=256)
def _snapshot_bytes(config: str, overrides: tuple[str, ...], store: str, world_size: int, gpus: bool) -> float:
    """kubetron plan's estimate of one rank's memory snapshot (cached: the job is parsed on every reconcile)."""
    cfg = ConfigContainer.from_dict(trainer_config(config, overrides, store))
    cfg.derive(world_size=world_size, cuda_available=gpus)
    return snapshot_bytes(cfg, world_size)


def check_snapshot_memory(spec: JobSpec) -> None:
    """A pod's memory limit must hold its snapshots (the volume, and the host copy each rank writes them from;
    on CPU pods also the model's own memory, kubetron plan's estimate): else SpecError, before any pod
    exists, rather than pods killed for their memory again and again."""
    limit = recovery.parse_quantity((spec.resources.get("limits") or {}).get("memory"))
    volume = spec.snapshot_volume
    if not volume or limit is None:
        return
    host_copies = spec.snapshot_bytes * spec.nproc_per_node
    needed = volume + host_copies
    if needed > limit:
        raise SpecError("spec.memorySnapshots", (
            f"the pods' memory limit ({spec.resources['limits']['memory']}) cannot hold their snapshots in memory: "
            f"{recovery.format_bytes(volume)} for the memory volume (kubetron plan's estimate: "
            f"{recovery.format_bytes(spec.snapshot_bytes)} per rank, {recovery.KEEP} of each of "
            f"{spec.nproc_per_node} rank(s), their copies of another pod's) and "
            f"{recovery.format_bytes(host_copies)} of host copies; raise spec.resources.limits.memory to at least "
            f"{recovery.format_bytes(needed)} plus what the trainer itself needs, or set "
            f"spec.memorySnapshots.enabled: false (docs/recovery.md)"))


def elastic_sizes(spec: JobSpec, store: str) -> tuple[tuple[int, ...], str]:
    """The node counts in [minNodes, nodes] whose world size the trainer's config accepts (derive()), and
    a note when minNodes had to be rounded up to the smallest of them. A size that does not work (the
    global batch not divisible by micro batch x data-parallel size, TP x PP not dividing the world) is
    skipped; when no size below `nodes` works the job is refused, naming spec.minNodes."""
    return _elastic_sizes(spec.config, spec.overrides, store, spec.min_nodes or spec.nodes, spec.nodes,
                          spec.nproc_per_node, spec.gpus_per_node > 0)


@functools.lru_cache(maxsize=256)
def _elastic_sizes(config: str, overrides: tuple[str, ...], store: str, low: int, nodes: int, nproc: int,
                   gpus: bool) -> tuple[tuple[int, ...], str]:
    # Cached: the operator parses the job on every reconcile; derive() per size is ~1 ms.
    if low >= nodes:  # not elastic: one size, which check_trainer_config derives
        return (nodes,), ""
    data, sizes, first_error = trainer_config(config, overrides, store), [], ""
    for n in range(low, nodes):
        try:
            derive_at(data, n * nproc, gpus)
        except SpecError as exc:
            first_error = first_error or f"{n} node(s): {exc}"
            continue
        sizes.append(n)
    if low < nodes and not sizes:
        raise SpecError("spec.minNodes", f"no size in [{low}, {nodes - 1}] works for spec.config; {first_error}")
    note = f"spec.minNodes {low} rounded up to {sizes[0]} ({first_error})" if sizes and sizes[0] != low else ""
    return (*sizes, nodes), note


def parse_spec(spec: Mapping[str, Any]) -> JobSpec:
    """spec dict -> JobSpec, checking what the CRD schema cannot express."""
    for key in ("image", "nodes", "config", "storage"):
        if spec.get(key) in (None, ""):
            raise SpecError(f"spec.{key}", "is required")
    nodes = _int(spec, "nodes", minimum=1)
    gpus = _int(spec, "gpusPerNode", 0, minimum=0)
    mode = spec.get("mode") or "pretrain"
    if mode not in ("pretrain", "finetune"):
        raise SpecError("spec.mode", f"must be pretrain or finetune, got {mode!r}")
    env = tuple(spec.get("env") or ())
    for i, var in enumerate(env):
        if not isinstance(var, Mapping) or not var.get("name"):
            raise SpecError(f"spec.env[{i}]", "needs a name")
        if var["name"] in RESERVED_ENV:
            raise SpecError(f"spec.env[{i}]", f"{var['name']} is set by the operator")
    overrides = tuple(str(o) for o in spec.get("overrides") or ())
    for i, item in enumerate(overrides):
        key = item.partition("=")[0].strip()
        if key in STORE_KEYS:
            raise SpecError(f"spec.overrides[{i}]", f"{key} is set by the operator to the job's store "
                            "(spec.storage); change spec.storage instead")
    resources = dict(spec.get("resources") or {})
    _check_gpu_resources(resources, gpus)
    ports = _int(spec, "statusPort", 8080, minimum=0), _int(spec, "masterPort", 29500, minimum=1)
    if ports[0] == ports[1]:
        raise SpecError("spec.statusPort", f"must differ from spec.masterPort (both {ports[0]})")
    _check_attempt_bytes(spec, nodes)
    return JobSpec(
        image=str(spec["image"]),
        nodes=nodes,
        config=str(spec["config"]),
        storage=_parse_storage(spec["storage"]),
        gpus_per_node=gpus,
        resources=resources,
        mode=mode,
        overrides=overrides,
        backoff_limit=_int(spec, "backoffLimit", 3, minimum=0),
        max_no_progress_attempts=_int(spec, "maxNoProgressAttempts", 3, minimum=1),
        suspend=bool(spec.get("suspend", False)),
        active_deadline_seconds=_opt_int(spec, "activeDeadlineSeconds"),
        ttl_seconds_after_finished=_opt_int(spec, "ttlSecondsAfterFinished"),
        termination_grace_period_seconds=_int(spec, "terminationGracePeriodSeconds", 120, minimum=0),
        startup_timeout_seconds=_int(spec, "startupTimeoutSeconds", 600, minimum=1),
        max_never_started_attempts=_int(spec, "maxNeverStartedAttempts", 5, minimum=1),
        max_in_place_restarts=_int(spec, "maxInPlaceRestarts", 3, minimum=0),
        hang_timeout_seconds=_opt_int(spec, "hangTimeoutSeconds"),
        min_nodes=_min_nodes(spec, nodes),
        shrink_after_seconds=_int(spec, "shrinkAfterSeconds", 60, minimum=1),
        status_port=ports[0],
        master_port=ports[1],
        env=env,
        scheduling=_parse_scheduling(spec.get("scheduling") or {}),
        image_pull_policy=spec.get("imagePullPolicy") or "",
        image_pull_secrets=tuple(_name(s.get("name"), f"spec.imagePullSecrets[{i}].name")
                                 for i, s in enumerate(spec.get("imagePullSecrets") or ())),
        service_account_name=_name(spec.get("serviceAccountName"), "spec.serviceAccountName", optional=True),
        queue_name=_name(spec.get("queueName"), "spec.queueName", optional=True, max_length=63),
        pod_template=parse_pod_template(spec.get("podTemplate") or {}, spec),
        memory_snapshots=_parse_memory_snapshots(spec.get("memorySnapshots") or {}),
    )


def _parse_memory_snapshots(value: Any) -> MemorySnapshots:
    if not isinstance(value, Mapping):
        raise SpecError("spec.memorySnapshots", "must be an object")
    counts = {}
    for key, default in (("replicationFactor", recovery.DEFAULT_FACTOR), ("replicationJump", recovery.DEFAULT_JUMP)):
        n = value.get(key, default)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpecError(f"spec.memorySnapshots.{key}", f"must be an integer >= 1, got {shown(n)}")
        counts[key] = n
    return MemorySnapshots(enabled=value.get("enabled", True) is not False, factor=counts["replicationFactor"],
                           jump=counts["replicationJump"])


def is_name(value: Any, max_length: int = NAME_MAX) -> bool:
    """`value` is a Kubernetes object name (NAME_PATTERN) of at most `max_length` characters."""
    return isinstance(value, str) and len(value) <= max_length and _NAME.fullmatch(value) is not None


def _name(value: Any, where: str, optional: bool = False, max_length: int = NAME_MAX) -> str:
    """A name the spec gives (it ends up in request paths and pods) when it is a Kubernetes name, else
    SpecError naming `where`; with `optional`, None and "" read as "" (none)."""
    if optional and value in (None, ""):
        return ""
    if not is_name(value, max_length):
        raise SpecError(where, f"must be a Kubernetes name (lowercase letters, digits, '-' and '.', at most "
                               f"{max_length} characters), got {shown(value)}")
    return str(value)


def shown(value: Any, limit: int = 80) -> str:
    """`value` as an error message quotes it: repr (control characters escaped), cut to `limit`."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_attempt_bytes(spec: Mapping[str, Any], nodes: int) -> None:
    """What one attempt makes the operator create is bounded (ATTEMPT_LIMIT): every pod carries the config,
    the pod template, the env and the overrides. The CRD refuses config x nodes at apply time already."""
    per_pod = POD_OVERHEAD + len(str(spec.get("config") or "").encode()) + sum(
        len(json.dumps(spec.get(key) or "")) for key in ("podTemplate", "env", "overrides"))
    if per_pod * nodes > ATTEMPT_LIMIT:
        raise SpecError("spec.nodes", f"{nodes} pods of {per_pod // 1024} KiB each (spec.config, podTemplate, env "
                        f"and overrides are copied onto every pod) make {per_pod * nodes / 2**20:.0f} MiB per "
                        f"attempt, more than {ATTEMPT_LIMIT // 2**20} MiB; keep files on the volume, not in the spec")


def _min_nodes(spec: Mapping[str, Any], nodes: int) -> int:
    low = _int(spec, "minNodes", nodes, minimum=1)
    if low > nodes:
        raise SpecError("spec.minNodes", f"must be at most spec.nodes ({nodes}), got {low}")
    return low


def _check_gpu_resources(resources: Mapping[str, Any], gpus: int) -> None:
    """spec.gpusPerNode is the one place GPUs are asked for; a GPU request or limit must agree with it."""
    for kind in ("limits", "requests"):
        value = (resources.get(kind) or {}).get(GPU)
        if value is not None and str(value) != str(gpus):
            raise SpecError(f"spec.resources.{kind}[{GPU}]", f"{value} disagrees with spec.gpusPerNode ({gpus}); "
                            "set only gpusPerNode")


@functools.lru_cache(maxsize=256)
def check_trainer_config(config: str, overrides: tuple[str, ...], store: str, world_size: int, gpus: bool) -> None:
    """Parse spec.config + spec.overrides + the store overrides with the trainer's own ConfigContainer
    and derive it for this world size: what the trainer's command line (build.trainer_args) will load.

    Why here: a config the trainer would reject (exit 2) must fail the job before a single GPU pod is
    scheduled. kubetron.contract.config needs only pydantic and yaml (no torch), so the operator can afford it.
    Only the pure part (ConfigContainer.derive: schema, types, cross-field and world-size arithmetic):
    what reads the pod's files, S3 or environment (tokenizer files, data and checkpoint paths, KUBETRON_*
    defaults) is checked by the trainer at start (ConfigContainer.resolve), where those exist.
    Cached (a config that passed passes again; one that failed raises anew): jobs of one sweep share it.
    """
    derive_at(trainer_config(config, overrides, store), world_size, gpus)


def trainer_config(config: str, overrides: tuple[str, ...], store: str) -> dict[str, Any]:
    """spec.config + spec.overrides + the store overrides, as the trainer's command line composes them."""
    stores = [f"{key}={store}" for key in STORE_KEYS]
    try:  # a copy: the parse is shared by the jobs of one config (a sweep), each job's store is its own
        return apply_overrides(copy.deepcopy(_users_config(config, overrides)), stores)
    except ConfigError as exc:
        raise SpecError("spec.config", str(exc)) from None


@functools.lru_cache(maxsize=256)
def _users_config(config: str, overrides: tuple[str, ...]) -> dict[str, Any]:
    """spec.config + spec.overrides, parsed (cached: never change what it returns; a config that fails raises anew)."""
    if (size := len(config.encode())) > CONFIG_LIMIT:
        raise SpecError("spec.config", f"is {size / 1024:.0f} KiB; at most {CONFIG_LIMIT // 1024} KiB fit the pod "
                                       "annotation that carries it (keep data and tokenizer files on the volume)")
    try:
        data = yaml.safe_load(config)
    except yaml.YAMLError as exc:
        raise SpecError("spec.config", f"invalid YAML: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise SpecError("spec.config", f"expected a mapping of sections, got {type(data).__name__}")
    try:
        return apply_overrides(data, overrides)
    except ConfigError as exc:
        raise SpecError("spec.overrides", str(exc)) from None


def derive_at(data: dict[str, Any], world_size: int, gpus: bool) -> None:
    """ConfigContainer.derive of trainer_config()'s data for `world_size`, or SpecError naming spec.config."""
    try:
        ConfigContainer.from_dict(data).derive(world_size=world_size, cuda_available=gpus)
    except ConfigError as exc:
        raise SpecError("spec.config", str(exc)) from None


def _parse_storage(storage: Mapping[str, Any]) -> S3Storage | PvcStorage:
    if not isinstance(storage, Mapping) or len([k for k in ("s3", "pvc") if storage.get(k)]) != 1:
        raise SpecError("spec.storage", "needs exactly one of s3 or pvc")
    if storage.get("s3"):
        return _parse_s3(storage["s3"])
    pvc = storage["pvc"]
    claim = _name(pvc.get("claimName"), "spec.storage.pvc.claimName")
    mount = pvc.get("mountPath") or "/ckpt"
    if not mount.startswith("/"):
        raise SpecError("spec.storage.pvc.mountPath", "must be an absolute path")
    sub = pvc.get("subPath") or ""
    if ".." in sub.split("/"):
        raise SpecError("spec.storage.pvc.subPath", "may not contain '..'")
    return PvcStorage(claim_name=claim, mount_path=mount, sub_path=sub)


def _parse_s3(s3: Mapping[str, Any]) -> S3Storage:
    """spec.storage.s3: every part of it names something outside the job (a bucket, an endpoint, a Secret)."""
    f = "spec.storage.s3"
    bucket, prefix, endpoint = s3.get("bucket"), s3.get("prefix") or "", s3.get("endpoint") or ""
    if not isinstance(bucket, str) or not _BUCKET.fullmatch(bucket):
        raise SpecError(f"{f}.bucket", "must be an S3 bucket name (3-63 lowercase letters, digits, '.' and '-'), "
                        f"got {shown(bucket)}")
    if not isinstance(prefix, str) or any(seg in (".", "..") for seg in prefix.split("/")) or not prefix.isprintable():
        raise SpecError(f"{f}.prefix", f"may not have '.' or '..' segments or control characters, got {shown(prefix)}")
    if not isinstance(endpoint, str) or not _ENDPOINT.fullmatch(endpoint):
        raise SpecError(f"{f}.endpoint", f"must be an http:// or https:// URL of a host, got {shown(endpoint)}")
    region = s3.get("region") or ""
    if not isinstance(region, str) or not _REGION.fullmatch(region):
        raise SpecError(f"{f}.region", f"must be a region name (lowercase letters, digits, '-'), got {shown(region)}")
    ref = s3.get("secretRef")
    secret = _name((ref or {}).get("name"), f"{f}.secretRef.name") if ref is not None else ""
    return S3Storage(bucket=bucket, secret_name=secret, prefix=prefix, endpoint=endpoint, region=region)


def _parse_scheduling(s: Mapping[str, Any]) -> Scheduling:
    gang = s.get("gang") or "none"
    if gang not in ("none", "volcano", "coscheduling", "kubernetes"):
        raise SpecError("spec.scheduling.gang", f"must be none, volcano, coscheduling or kubernetes, got {gang!r}")
    return Scheduling(
        scheduler_name=_name(s.get("schedulerName"), "spec.scheduling.schedulerName", optional=True),
        priority_class_name=_name(s.get("priorityClassName"), "spec.scheduling.priorityClassName", optional=True),
        node_selector=dict(s.get("nodeSelector") or {}),
        tolerations=tuple(s.get("tolerations") or ()),
        affinity=dict(s.get("affinity") or {}),
        gang=gang,
    )


def parse_pod_template(t: Mapping[str, Any], spec: Mapping[str, Any]) -> PodTemplate:
    """spec.podTemplate -> PodTemplate. The operator's own fields win: a template that would change one of
    them (a reserved label, env var, volume or mount path, the trainer's image or command) is a SpecError,
    so the clash is reported before any pod exists instead of being silently dropped."""
    f = "spec.podTemplate"
    _only(t, ("metadata", "spec"), f)
    meta, pspec = t.get("metadata") or {}, t.get("spec") or {}
    _only(meta, ("labels", "annotations"), f"{f}.metadata")
    _only(pspec, TEMPLATE_SPEC_KEYS, f"{f}.spec")
    labels = _string_map(meta.get("labels"), f"{f}.metadata.labels", RESERVED_LABELS, RESERVED_LABEL_PREFIXES)
    annotations = _string_map(meta.get("annotations"), f"{f}.metadata.annotations", RESERVED_ANNOTATIONS)
    volumes = _named(pspec.get("volumes"), f"{f}.spec.volumes", RESERVED_VOLUMES)
    inits = _named(pspec.get("initContainers"), f"{f}.spec.initContainers", RESERVED_CONTAINERS | {TRAINER})
    containers = _named(pspec.get("containers"), f"{f}.spec.containers", RESERVED_CONTAINERS)
    trainer = [c for c in containers if c["name"] == TRAINER]
    sidecars = tuple(c for c in containers if c["name"] != TRAINER)
    env: tuple[Mapping[str, Any], ...] = ()
    env_from: tuple[Mapping[str, Any], ...] = ()
    mounts: tuple[Mapping[str, Any], ...] = ()
    caps: tuple[str, ...] = ()
    if trainer:
        i = containers.index(trainer[0])
        tf = f"{f}.spec.containers[{i}]"
        _only(trainer[0], TRAINER_KEYS, tf, why="the operator owns the rest of the trainer container")
        env = tuple(_named(trainer[0].get("env"), f"{tf}.env", RESERVED_ENV))
        env_from = tuple(_list(trainer[0].get("envFrom"), f"{tf}.envFrom"))
        mounts = tuple(_named(trainer[0].get("volumeMounts"), f"{tf}.volumeMounts", RESERVED_VOLUMES))
        caps = _capabilities(trainer[0].get("securityContext") or {}, f"{tf}.securityContext")
        reserved_paths = {"/etc/kubetron", "/dev/shm", recovery.SNAPSHOT_MOUNT, PEER_TOKEN_MOUNT,
                          ((spec.get("storage") or {}).get("pvc") or {}).get("mountPath") or "/ckpt"}
        for j, m in enumerate(mounts):
            if str(m.get("mountPath", "")).rstrip("/") in reserved_paths:
                raise SpecError(f"{tf}.volumeMounts[{j}].mountPath", f"{m.get('mountPath')} is used by the operator")
    host_network = pspec.get("hostNetwork", False)
    if not isinstance(host_network, bool):
        raise SpecError(f"{f}.spec.hostNetwork", f"must be true or false, got {host_network!r}")
    return PodTemplate(labels=labels, annotations=annotations, host_network=host_network, volumes=tuple(volumes),
                       init_containers=tuple(inits), sidecars=sidecars, env=env, env_from=env_from,
                       volume_mounts=mounts, capabilities=caps)


def _only(obj: Any, allowed: tuple[str, ...], where: str, why: str = "") -> None:
    if not isinstance(obj, Mapping):
        raise SpecError(where, f"must be an object, got {type(obj).__name__}")
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise SpecError(f"{where}.{extra[0]}", f"is not supported here (allowed: {', '.join(allowed)})"
                        + (f"; {why}" if why else ""))


def _list(value: Any, where: str) -> list[Mapping[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise SpecError(where, "must be a list of objects")
    return [dict(v) for v in value]


def _named(value: Any, where: str, reserved: frozenset[str] | set[str]) -> list[Mapping[str, Any]]:
    """A list of objects with unique names, none of them reserved by the operator."""
    items, seen = _list(value, where), set[str]()
    for i, item in enumerate(items):
        name = item.get("name")
        if not name or not isinstance(name, str):
            raise SpecError(f"{where}[{i}].name", "is required")
        if name in reserved:
            raise SpecError(f"{where}[{i}].name", f"{name} is set by the operator")
        if name in seen:
            raise SpecError(f"{where}[{i}].name", f"{name} appears twice")
        seen.add(name)
    return items


def _string_map(value: Any, where: str, reserved: frozenset[str], prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise SpecError(where, "must map names to strings")
    for key in value:
        if key in reserved or str(key).startswith(prefixes):
            raise SpecError(f"{where}[{key}]", "is set by the operator")
    return dict(value)


def _capabilities(sc: Mapping[str, Any], where: str) -> tuple[str, ...]:
    _only(sc, ("capabilities",), where, why="the operator sets the trainer's security context (non-root)")
    caps = sc.get("capabilities") or {}
    _only(caps, ("add",), f"{where}.capabilities", why="the operator drops ALL and adds only these")
    add = caps.get("add") or []
    if not isinstance(add, list) or not all(isinstance(c, str) and c for c in add):
        raise SpecError(f"{where}.capabilities.add", "must be a list of capability names (e.g. IPC_LOCK)")
    return tuple(add)


def _int(spec: Mapping[str, Any], key: str, default: int | None = None, *, minimum: int) -> int:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"spec.{key}", f"must be an integer >= {minimum}, got {value!r}")
    return value


def _opt_int(spec: Mapping[str, Any], key: str) -> int | None:
    return None if spec.get(key) is None else _int(spec, key, minimum=0)
