"""Recovery from memory (docs/recovery.md): what the trainer, the pods' agents and the operator share about
memory snapshots and their copies on peers. Standard library only, no I/O.

- The pods' environment: the memory volume's path, the per-job token the agents' copies are guarded by, the
  replication (factor, jump) and the volume's size (what a copy may take).
- Which pods hold whose copies (`holders`, `held_by`): Megatron's replication factor and jump, over pods: a
  pod's snapshots are also held by the pods (pod + k x jump) mod pods, k = 1 .. factor - 1 (with the defaults
  2 and 1, a ring: each pod holds the previous pod's). Megatron forms cliques of factor x jump ranks instead;
  a ring works for any number of pods.
- What the memory volume must hold (`volume_bytes`).
- How a run resumed: the trainer's report (`TrainerRecovery`, rank 0's status endpoint `recovery`) and the
  operator's record (`LastRecovery`, status.lastRecovery).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypedDict

SNAPSHOT_DIR_ENV = "KUBETRON_SNAPSHOT_DIR"  # the pod's memory volume: the trainer snapshots into it by default
PEER_TOKEN_ENV = "KUBETRON_PEER_TOKEN"  # the job's token: only its pods' agents read or write its copies
REPLICATION_FACTOR_ENV = "KUBETRON_REPLICATION_FACTOR"  # pods holding each pod's newest snapshot, its own included
REPLICATION_JUMP_ENV = "KUBETRON_REPLICATION_JUMP"  # the spacing of those pods
SNAPSHOT_LIMIT_ENV = "KUBETRON_SNAPSHOT_LIMIT_BYTES"  # the memory volume's size: what the copies there may take
POD_IP_ENV = "KUBETRON_POD_IP"  # where the other pods reach this pod's agent (the downward API's status.podIP)
COPIES_ENV = "KUBETRON_PEER_COPIES"  # the agent's, for its ranks: "1" when it copies their snapshots to peers
POD_ENV = (SNAPSHOT_DIR_ENV, PEER_TOKEN_ENV, REPLICATION_FACTOR_ENV, REPLICATION_JUMP_ENV, SNAPSHOT_LIMIT_ENV,
           POD_IP_ENV)
"""What the operator sets on every pod for the snapshots (a spec.env entry may not override them)."""
SNAPSHOT_MOUNT = "/var/run/kubetron/snapshots"  # where the pods mount their memory volume
PEER_TOKEN_KEY = "token"  # the key of the job's peer Secret (<job>-peers) that holds the token

MEMORY, PEER, STORE = "memory", "peer", "store"
LOADED_FROM = (MEMORY, PEER, STORE)
IN_PLACE, POD_REPLACED, NEW_ATTEMPT = "inPlace", "podReplaced", "newAttempt"
KINDS = (IN_PLACE, POD_REPLACED, NEW_ATTEMPT)

KEEP = 2  # snapshots of one rank a pod holds at most (the newest complete one and the one being written)
DEFAULT_FACTOR, DEFAULT_JUMP = 2, 1
VOLUME_HEADROOM = 1.1  # the volume over what the snapshots need: manifests, indexes, the common state
VOLUME_FLOOR = 64 << 20  # bytes: the smallest volume (a tiny model's snapshots are KBs)


def holders(pod: int, pods: int, factor: int = DEFAULT_FACTOR, jump: int = DEFAULT_JUMP) -> list[int]:
    """The other pods that hold copies of pod `pod`'s snapshots, in the order its agent sends them."""
    out: list[int] = []
    for k in range(1, max(factor, 1)):
        other = (pod + k * jump) % pods
        if other != pod and other not in out:
            out.append(other)
    return out


def held_by(pod: int, pods: int, factor: int = DEFAULT_FACTOR, jump: int = DEFAULT_JUMP) -> list[int]:
    """The pods whose snapshots pod `pod` holds copies of."""
    return [p for p in range(pods) if pod in holders(p, pods, factor, jump)]


def volume_bytes(snapshot_bytes: float, ranks_per_pod: int, pods: int, factor: int = DEFAULT_FACTOR,
                 jump: int = DEFAULT_JUMP) -> int:
    """The memory volume a pod needs: KEEP snapshots of each of its ranks (`snapshot_bytes` each), and as many
    of the ranks of every pod it holds copies of, with some headroom; at least VOLUME_FLOOR."""
    copies = 1 + max((len(held_by(p, pods, factor, jump)) for p in range(pods)), default=0)
    return max(VOLUME_FLOOR, math.ceil(KEEP * copies * ranks_per_pod * snapshot_bytes * VOLUME_HEADROOM))


_SUFFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "": 1}


def parse_quantity(text: Any) -> int | None:
    """A Kubernetes memory quantity ("64Gi", "500M", "1e9", 1024) in bytes, rounded up; None when it is none."""
    value = str(text).strip()
    number = value.rstrip("KMGTPEik")
    suffix = value[len(number):]
    if suffix not in _SUFFIXES:
        return None
    try:
        amount = float(number)
    except ValueError:
        return None
    return math.ceil(amount * _SUFFIXES[suffix]) if math.isfinite(amount) and amount >= 0 else None


def format_bytes(n: float) -> str:
    """`n` bytes as a person reads them (GiB/MiB, one decimal)."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


class TrainerRecovery(TypedDict):
    """How this trainer process resumed (rank 0's status endpoint, `recovery`; null on a first start afresh). A
    start at iteration 0 after a restart, or after snapshots that failed their checks, is one: `store` at 0 (the
    store held no checkpoint yet), with the reason."""

    loadedFrom: str  # memory | peer | store
    iteration: int  # the iteration it resumed from (0: nothing loaded, started afresh)
    seconds: float  # reading and restoring that state
    reason: str  # why not from memory ("" when it was)
    failed: bool  # a snapshot the gang agreed on failed its checks (torn, corrupted): the store instead
    restart: int  # the in-place restart it followed (0: the attempt's first start)


class LastRecovery(TypedDict):
    """status.lastRecovery: the newest recovery of the job."""

    kind: str  # inPlace | podReplaced | newAttempt
    loadedFrom: str
    iteration: int
    seconds: float
    reason: str
    attempt: int
    restart: int


def parse_trainer_recovery(data: Any) -> TrainerRecovery | None:
    """The endpoint's `recovery`, checked (None when it is not one)."""
    if not isinstance(data, Mapping) or data.get("loadedFrom") not in LOADED_FROM:
        return None
    iteration, restart, seconds = data.get("iteration"), data.get("restart"), data.get("seconds")
    if not (isinstance(iteration, int) and isinstance(restart, int) and _count(iteration) and _count(restart)
            and isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
            and seconds >= 0):
        return None
    reason = data.get("reason")
    return TrainerRecovery(loadedFrom=data["loadedFrom"], iteration=iteration, seconds=float(seconds),
                           reason=reason[:500] if isinstance(reason, str) else "", failed=data.get("failed") is True,
                           restart=restart)


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 62
