"""TrainingJob bodies shared by the operator tests."""

from __future__ import annotations

import base64
import copy
from datetime import datetime
from typing import Any

CONFIG = "model:\n  num_layers: 2\ntrain:\n  train_iters: 40\n"

PVC_JOB: dict[str, Any] = {
    "apiVersion": "kubetron.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "gpt", "namespace": "ml", "uid": "uid-123"},
    "spec": {
        "image": "kubetron:dev",
        "nodes": 2,
        "gpusPerNode": 0,
        "config": CONFIG,
        "storage": {"pvc": {"claimName": "ckpt"}},
        "backoffLimit": 2,
        "statusPort": 8080,
    },
}

S3_JOB: dict[str, Any] = copy.deepcopy(PVC_JOB)
S3_JOB["spec"]["storage"] = {"s3": {"bucket": "bkt", "prefix": "runs", "endpoint": "http://s3:9000",
                                    "region": "us-east-1", "secretRef": {"name": "s3-creds"}}}


def job_body(base: dict[str, Any] = PVC_JOB, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(base)
    body["spec"].update(spec)
    return body


def kubectl_get(job: dict[str, Any], now: datetime) -> str:
    """`kubectl get trainingjobs`, from the CRD's printer columns."""
    st = job.get("status") or {}
    created = datetime.fromisoformat(job["metadata"]["creationTimestamp"])
    age = f"{max(0, int((now - created).total_seconds()))}s"
    row = [job["metadata"]["name"], st.get("phase", ""), str(st.get("nodes", "")), st.get("progress", ""),
           str(st.get("iteration", "")),
           str((st.get("restarts") or {}).get("total", "")), st.get("eta") or "<none>", age]
    head = ["NAME", "PHASE", "NODES", "PROGRESS", "ITERATION", "RESTARTS", "ETA", "AGE"]
    widths = [max(len(a), len(b)) + 3 for a, b in zip(head, row, strict=True)]
    return "\n".join("".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in (head, row))


def tj(ns: str, name: str = "gpt", **spec: Any) -> dict[str, Any]:
    """An S3 TrainingJob to create in namespace `ns` of the real API server (tests/kube)."""
    body = copy.deepcopy(S3_JOB)
    body["metadata"] = {"name": name, "namespace": ns}
    body["spec"].update(spec)
    return body


def s3_job(kube: Any, ns: str, s3_server: Any, name: str = "gpt", **spec: Any) -> dict[str, Any]:
    """tj() whose store is a fresh bucket of the real S3 server; its Secret (s3-creds) holds the keys."""
    bucket = s3_server.new_bucket()
    kube.admin.create(f"/api/v1/namespaces/{ns}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
        "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(s3_server.access_key.encode()).decode(),
                 "AWS_SECRET_ACCESS_KEY": base64.b64encode(s3_server.secret_key.encode()).decode()}}, ok=(409,))
    body = tj(ns, name, **spec)
    body["spec"]["storage"]["s3"].update(bucket=bucket, endpoint=s3_server.endpoint)
    return body
