"""`kubetron operator`: run the TrainingJob operator (kopf) with a liveness endpoint and optional peering."""

from __future__ import annotations

import argparse
import functools
import logging
import secrets
from typing import Any

import kopf
from kubetron.contract.errors import ConfigError

from kubetron_operator import compat_kopf, deps, handlers
from kubetron_operator.api_calls import Kube, kubernetes_stream, kubernetes_transport
from kubetron_operator.node_taints import Taints
from kubetron_operator.pod_cache import WATCH_SECONDS
from kubetron_operator.trainer_reports.store_log import read_s3_progress
from kubetron_operator.untrusted import LOG_LIMIT, clean

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def client_configuration() -> Any:
    """The cluster's address and credentials: in-cluster service account first, then the kubeconfig
    ($KUBECONFIG or ~/.kube/config). Both our API calls and kopf's use this one configuration."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            config.load_kube_config(client_configuration=configuration)
        except (config.ConfigException, OSError) as exc:
            raise ConfigError("cluster", f"no in-cluster service account and no usable kubeconfig ({exc})") from exc
    return configuration


def connection_info(configuration: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from a kubernetes client Configuration. Asked again whenever the API answers
    401, so a rotated service-account token is picked up (the client re-reads its token file)."""
    header = (configuration.get_api_key_with_prefix("BearerToken")
              or configuration.get_api_key_with_prefix("authorization") or "")
    scheme, _, token = header.rpartition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host, ca_path=configuration.ssl_ca_cert, insecure=not configuration.verify_ssl,
        scheme=scheme or ("Bearer" if token else None), token=token or None,
        certificate_path=configuration.cert_file, private_key_path=configuration.key_file,
        username=configuration.username or None, password=configuration.password or None,
    )


def settings(peering: str | None) -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    s.persistence.finalizer = handlers.FINALIZER
    s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kubetron.dev")
    s.posting.level = logging.WARNING  # our own events are posted explicitly; kopf's only on trouble
    s.peering.standalone = not peering
    if peering:
        s.peering.name = peering
        s.peering.mandatory = True
        # kopf pauses every operator that sees a peer of equal or higher priority: identical replicas
        # would all pause. A random priority per process makes one of them the leader; when it goes
        # away (or its keep-alive lapses) the next highest resumes.
        s.peering.priority = secrets.randbelow(2**31 - 1) + 1
    return s


class OneLineFormatter(logging.Formatter):
    """Every log record's message on one line: control characters (a newline a trainer put in its message,
    an ANSI escape) are written as escapes, so nothing a pod says can forge a line of the operator's log.
    A message is cut at LOG_LIMIT characters. Tracebacks keep their lines (they are formatted after the message)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = clean(record.message, LOG_LIMIT)
        return super().formatMessage(record)


def run(args: argparse.Namespace) -> int:
    """Blocks until the operator stops. `args`: namespace(s) (list; empty = cluster-wide), liveness
    (endpoint URL, "" to disable), peering (a KopfPeering name for HA, or None), interval (seconds),
    gang_schedulers (those whose PodGroups the role grants; None: all), s3_operator_buckets (buckets whose jobs
    without a secretRef the operator reads with its own identity; default none), taint_failing_nodes (the role
    may get and patch nodes: taint the ones that keep failing jobs, node_taints.py), taint_seconds (how long
    such a taint stays; default 3600)."""
    from kubernetes import client

    namespaces = list(getattr(args, "namespaces", None) or getattr(args, "namespace", None) or [])
    if isinstance(namespaces, str):
        namespaces = [namespaces]
    patterns = [ns for ns in namespaces if set(ns) & set("*?[]!")]
    if patterns:
        raise ConfigError("--namespace", f"{patterns[0]!r} is a pattern; name each namespace to watch (or none: "
                          "every namespace)")
    peering = getattr(args, "peering", None) or None
    liveness = getattr(args, "liveness", DEFAULT_LIVENESS)
    interval = float(getattr(args, "interval", None) or 5.0)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    # The client's pool says "Retrying" up to three times per failed request; the failure itself is our one line.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    # A plain registry: kopf's implicit login handlers went away with SmartOperatorRegistry, so say
    # how to log in (the same credentials our own calls use), below. kopf is checked and adapted first: a
    # job's daemon asks for no finalizer, no diff base is kept, job_event's thousands of "succeeded" lines
    # a minute are not logged.
    registry, kopf_settings = handlers.register(kopf.OperatorRegistry()), settings(peering)
    compat_kopf.install(registry, kopf_settings, daemons=[handlers.reconcile_daemon], quiet=[handlers.job_event])
    configuration = client_configuration()
    metrics_port = int(getattr(args, "metrics_port", 0) or 0)
    if metrics_port:
        from kubetron_operator import metrics

        metrics.serve(metrics_port)
    kopf.on.login(registry=registry)(lambda **_: connection_info(configuration))
    # A connection per reconcile and read thread, one for the event poster and one per pod watch (an extra one
    # would be a new TLS handshake per request, its connection discarded after).
    configuration.connection_pool_maxsize = (deps.RECONCILE_THREADS + deps.IO_THREADS + 1
                                             + max(1, len(namespaces)))
    gang = getattr(args, "gang_schedulers", None)
    api_client = client.ApiClient(configuration)
    kube = Kube(kubernetes_transport(api_client), stream=kubernetes_stream(api_client, WATCH_SECONDS + 30),
                taint_nodes=bool(getattr(args, "taint_failing_nodes", False)),
                **({} if gang is None else {"gang_schedulers": gang}))
    own_buckets = tuple(getattr(args, "s3_operator_buckets", None) or ())
    used = deps.Deps(kube=kube, interval=interval, namespaces=tuple(namespaces),
                     read_progress=functools.partial(read_s3_progress, own_buckets=own_buckets))
    if kube.taint_nodes:  # its taints go once due, also those an earlier run of it left
        seconds = int(getattr(args, "taint_seconds", None) or 3600)
        if seconds < 1:
            raise ConfigError("--taint-seconds", f"{seconds}: a taint must last at least 1 second")
        used.taints = Taints(kube, float(seconds), used.clock)
        used.taints.start()
    kopf.run(
        registry=registry,
        settings=kopf_settings,
        memo=kopf.Memo(deps=used),
        standalone=not peering,
        peering_name=peering,
        liveness_endpoint=liveness or None,
        clusterwide=not namespaces,
        namespaces=namespaces,
    )
    return 0
