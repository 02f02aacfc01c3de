"""`kubetron operator`: run the TrainingJob operator (kopf) with a liveness endpoint and optional peering."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import kopf

from kubetron_operator import handlers
from kubetron_operator.api_calls import Kube, kubernetes_transport

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def api_client() -> Any:
    """A kubernetes ApiClient: in-cluster service account first, then the local kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def settings(peering: str | None) -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    s.persistence.finalizer = "kubetron.dev/operator"
    s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kubetron.dev")
    s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kubetron.dev")
    s.posting.level = logging.WARNING  # our own events are posted explicitly; kopf's only on trouble
    s.peering.standalone = not peering
    if peering:
        s.peering.name = peering
        s.peering.mandatory = True
    return s


def run(args: argparse.Namespace) -> int:
    """Blocks until the operator stops. `args`: namespace(s) (list; empty = cluster-wide), liveness
    (endpoint URL, "" to disable), peering (a KopfPeering name for HA, or None), interval (seconds)."""
    namespaces = list(getattr(args, "namespaces", None) or getattr(args, "namespace", None) or [])
    if isinstance(namespaces, str):
        namespaces = [namespaces]
    peering = getattr(args, "peering", None) or None
    liveness = getattr(args, "liveness", DEFAULT_LIVENESS)
    interval = float(getattr(args, "interval", None) or 5.0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry = handlers.register(kopf.SmartOperatorRegistry())
    deps = handlers.Deps(kube=Kube(kubernetes_transport(api_client())), interval=interval)
    kopf.run(
        registry=registry,
        settings=settings(peering),
        memo=kopf.Memo(deps=deps),
        standalone=not peering,
        peering_name=peering,
        liveness_endpoint=liveness or None,
        clusterwide=not namespaces,
        namespaces=namespaces,
    )
    return 0
