"""TrainingJob bodies shared by the operator tests."""

from __future__ import annotations

import copy
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from tests.trainer_utils import TINY

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


def tiny_config(train_iters: int = 100, save_interval: int = 10) -> str:
    """The tiny GPT at its smallest (1 layer, hidden 32) for jobs whose pods run as local processes;
    checkpoint.save/load are the operator's (the job's store)."""
    config = yaml.safe_load(Path(TINY).read_text())
    config["train"]["train_iters"] = train_iters
    config["model"].update(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=32)
    config["scheduler"]["lr_warmup_iters"] = 1
    config["validation"]["eval_interval"] = None
    config["checkpoint"] = {"save_interval": save_interval, "most_recent_k": 2}
    config["logger"] = {"log_interval": 1}
    return yaml.safe_dump(config)


def job_body(base: dict[str, Any] = PVC_JOB, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(base)
    body["spec"].update(spec)
    return body


def kubectl_get(job: dict[str, Any], now: datetime) -> str:
    """`kubectl get trainingjobs`, from the CRD's printer columns."""
    st = job.get("status") or {}
    created = datetime.fromisoformat(job["metadata"]["creationTimestamp"])
    age = f"{max(0, int((now - created).total_seconds()))}s"
    row = [job["metadata"]["name"], st.get("phase", ""), st.get("progress", ""), str(st.get("iteration", "")),
           str((st.get("restarts") or {}).get("total", "")), st.get("eta") or "<none>", age]
    head = ["NAME", "PHASE", "PROGRESS", "ITERATION", "RESTARTS", "ETA", "AGE"]
    widths = [max(len(a), len(b)) + 3 for a, b in zip(head, row, strict=True)]
    return "\n".join("".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in (head, row))
