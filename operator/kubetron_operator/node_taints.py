"""The cluster-wide taint of a failing node (the chart's failingNodes.taint, `kubetron operator
--taint-failing-nodes`; policy/nodes.py says when one is due) and its removal.

`Taints.taint`: for each node a job's decision pointed at (Action.taint_nodes), the verdict of
policy.nodes.taint_verdict, from one list of the nodes and the status of every job the operator watches; when
it says so, the node gets `TAINT_KEY=<namespace>:NoSchedule` and the annotation ANNOTATION (JSON: the
namespace, the job, the evidence, when, and `until`: --taint-seconds later).

`Taints.sweep` (a thread of its own): removes each of the operator's taints once its `until` has passed, and
at once one without a readable annotation (an earlier operator's, which never expired). It lists the nodes
at start, then sleeps until the next taint is due or a new one is made: no API call while no taint is held.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from kubetron.contract.times import parse_stamp, stamp

from kubetron_operator.api_calls import ApiError, Kube
from kubetron_operator.job_status import JobStatus
from kubetron_operator.node_view import NodeView
from kubetron_operator.policy.nodes import TAINT_KEY, avoiders, taint_verdict
from kubetron_operator.untrusted import clean

log = logging.getLogger("kubetron.nodes")

ANNOTATION = TAINT_KEY  # on a tainted node: who, why, until when
RETRY_SECONDS = 60.0  # after a sweep the API server refused


def ours(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The operator's taint on `node` (a Node's JSON), or None."""
    return next((t for t in (node.get("spec") or {}).get("taints") or () if t.get("key") == TAINT_KEY), None)


def until(node: Mapping[str, Any]) -> datetime | None:
    """When the operator's taint on `node` is due to go; None when its annotation does not say."""
    try:
        held = json.loads(((node.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION) or "")
    except ValueError:
        return None
    return parse_stamp(held.get("until")) if isinstance(held, dict) else None


def live_taints(nodes: Iterable[NodeView]) -> dict[str, int]:
    """namespace -> how many nodes carry a taint it triggered (the taint's value)."""
    out: dict[str, int] = {}
    for node in nodes:
        for taint in node.taints:
            if taint.get("key") == TAINT_KEY:
                out[str(taint.get("value") or "")] = out.get(str(taint.get("value") or ""), 0) + 1
    return out


def _adding(namespace: str, note: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    def change(node: dict[str, Any]) -> dict[str, Any] | None:
        if ours(node) is not None:
            return None
        taints = [*((node.get("spec") or {}).get("taints") or ()),
                  {"key": TAINT_KEY, "value": namespace, "effect": "NoSchedule"}]
        return {"metadata": {"annotations": {ANNOTATION: note}}, "spec": {"taints": taints}}
    return change


def _removing(now: datetime) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    def change(node: dict[str, Any]) -> dict[str, Any] | None:
        due = until(node)
        if ours(node) is None or (due is not None and due > now):
            return None
        taints = [t for t in (node.get("spec") or {}).get("taints") or () if t.get("key") != TAINT_KEY]
        return {"metadata": {"annotations": {ANNOTATION: None}}, "spec": {"taints": taints}}
    return change


class Taints:
    """The operator's taints (see the module docstring): `taint` from the reconcile threads, `sweep` in a
    thread of its own (`start`)."""

    def __init__(self, kube: Kube, seconds: float, clock: Callable[[], datetime]):
        self.kube, self.seconds, self.clock = kube, seconds, clock
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one verdict at a time: the per-namespace count holds

    def taint(self, names: Iterable[str], namespace: str, job: str, statuses: Iterable[tuple[str, JobStatus]],
              now: datetime) -> list[str]:
        """Taint those of `names` the verdict allows (a decision of job `namespace/job` pointed at them); the
        nodes tainted."""
        try:
            done = self._taint(list(names), namespace, job, list(statuses), now)
        except (ApiError, OSError) as exc:  # best effort: the job's own avoidance holds either way
            log.warning("cannot taint node(s) %s: %s", ", ".join(names), exc)
            return []
        if done:
            self._wake.set()
        return done

    def _taint(self, names: list[str], namespace: str, job: str, statuses: list[tuple[str, JobStatus]],
               now: datetime) -> list[str]:
        done: list[str] = []
        with self._lock:
            listed = {v.name: v for v in map(NodeView.from_node, self.kube.list_nodes())}
            counts = live_taints(listed.values())
            for name in names:
                if name not in listed:
                    continue
                ok, why = taint_verdict(listed[name], namespace, avoiders(statuses, name, now), counts)
                if not ok:
                    log.info("node %s not tainted: %s", name, why)
                    continue
                gone = now + timedelta(seconds=self.seconds)
                note = json.dumps({"namespace": namespace, "job": f"{namespace}/{job}", "evidence": clean(why, 1000),
                                   "time": stamp(now), "until": stamp(gone)})
                if self.kube.edit_node(name, _adding(namespace, note)):
                    counts[namespace] = counts.get(namespace, 0) + 1
                    done.append(name)
                    log.warning("tainted node %s %s=%s:NoSchedule until %s: %s", name, TAINT_KEY, namespace,
                                stamp(gone), why)
        return done

    def sweep(self) -> float | None:
        """Remove the operator's taints that are due; the seconds until the next one is (None: none held)."""
        now, due = self.clock(), None
        for node in self.kube.list_nodes():
            if ours(node) is None:
                continue
            name, when = (node.get("metadata") or {}).get("name") or "", until(node)
            if when is None or when <= now:
                if self.kube.edit_node(name, _removing(now)):
                    log.warning("removed taint %s from node %s (%s)", TAINT_KEY, name,
                                f"due at {stamp(when)}" if when else "an earlier operator's, with no end")
            else:
                left = (when - now).total_seconds()
                due = left if due is None else min(due, left)
        return due

    def start(self) -> None:
        threading.Thread(target=self._run, name="taints", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._wake.clear()  # before the sweep: a taint made during it wakes the next one
            try:
                due = self.sweep()
            except Exception as exc:  # noqa: BLE001 - the sweeper outlives any one bad round
                log.warning("cannot sweep the failing-node taints (again in %.0fs): %s", RETRY_SECONDS, exc)
                due = RETRY_SECONDS
            self._wake.wait(timeout=None if due is None else max(0.5, due))
