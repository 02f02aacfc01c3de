"""A Node as the operator reads it (NodeView.from_node): what tells whether a job's pod may land there (its
labels, taints, cordon, readiness, allocatable resources) and what the node itself says is wrong with it.

What a node says about itself comes from the kubelet, the device plugins and node-problem-detector, never
from a tenant's pods, so it may count against the node for every job (policy/nodes.py):

- a condition other than the kubelet's own (KUBELET_CONDITIONS) whose status is "True": node-problem-detector's
  convention (KernelDeadlock, ReadonlyFilesystem, a GPU health checker's GpuXidError ...);
- an extended resource (a vendor's `<domain>/<name>`: nvidia.com/gpu, amd.com/gpu ...) the node has fewer of
  allocatable than it has: the device plugin took unhealthy devices out (NVIDIA's does on an Xid 48/79).

Pure: it reads the Node's JSON only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from kubetron_operator.untrusted import clean

KUBELET_CONDITIONS = frozenset({"Ready", "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable"})
"""The conditions the kubelet and the cloud's route controller keep: about capacity or readiness, not a fault."""
CONTROL_PLANE = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
"""Labels (and taint keys) of a control-plane node."""
_SUFFIXES: dict[str, Decimal | int] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]{0,2})$")


def quantity(text: Any) -> Decimal | None:
    """A Kubernetes resource quantity ("500m", "64Gi", "8") as a number; None when it is not one."""
    match = _QUANTITY.match(str(text).strip())
    if match is None or match.group(2) not in _SUFFIXES:
        return None
    try:
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2)]
    except InvalidOperation:
        return None


@dataclass(frozen=True)
class NodeView:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, Any], ...] = ()
    unschedulable: bool = False  # cordoned
    ready: bool = True
    allocatable: Mapping[str, Decimal] = field(default_factory=dict)
    problems: tuple[str, ...] = ()  # what the node says is wrong with it (see the module docstring)

    @property
    def control_plane(self) -> bool:
        return any(k in self.labels for k in CONTROL_PLANE) or any(t.get("key") in CONTROL_PLANE for t in self.taints)

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> NodeView:
        meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
        conditions = status.get("conditions") or ()
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        allocatable = {k: q for k, v in (status.get("allocatable") or {}).items() if (q := quantity(v)) is not None}
        return cls(name=str(meta.get("name") or ""), labels=dict(meta.get("labels") or {}),
                   taints=tuple(spec.get("taints") or ()), unschedulable=bool(spec.get("unschedulable")), ready=ready,
                   allocatable=allocatable, problems=_problems(conditions, status))


def _problems(conditions: Any, status: Mapping[str, Any]) -> tuple[str, ...]:
    out = [clean(f"condition {c.get('type')}=True ({': '.join(x for x in (c.get('reason'), c.get('message')) if x)})",
                 300) for c in conditions if c.get("type") not in KUBELET_CONDITIONS and c.get("status") == "True"]
    capacity, allocatable = status.get("capacity") or {}, status.get("allocatable") or {}
    for name, total in sorted(capacity.items()):
        if "/" not in name or name.startswith(("kubernetes.io/", "hugepages-")):
            continue  # a vendor's device (nvidia.com/gpu), not cpu, memory or the node's own kinds
        have, usable = quantity(total), quantity(allocatable.get(name, 0))
        if have is not None and usable is not None and usable < have:
            out.append(clean(f"{name}: {usable} of {have} allocatable (unhealthy devices)", 300))
    return tuple(out)
