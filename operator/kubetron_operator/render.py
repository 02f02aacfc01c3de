"""`kubetron render trainingjob.yaml`: the manifests the operator would create for attempt 1."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from kubetron_operator.build import build
from kubetron_operator.model import API_VERSION, KIND, Job

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"  # the API server assigns the real one


def render(body: Mapping[str, Any], attempt: int = 1) -> list[dict[str, Any]]:
    """Manifests for one TrainingJob body (raises model.SpecError on an invalid spec)."""
    meta = dict(body.get("metadata") or {})
    meta.setdefault("uid", PLACEHOLDER_UID)
    return build(Job.from_body({**body, "metadata": meta}), attempt)


def render_file(path: str) -> str:
    """YAML (multi-document) of every TrainingJob in `path`, attempt 1."""
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    jobs = [d for d in docs if d.get("kind") == KIND and d.get("apiVersion") == API_VERSION]
    if not jobs:
        raise ValueError(f"{path}: no {API_VERSION} {KIND} found")
    out = []
    for body in jobs:
        name = (body.get("metadata") or {}).get("name")
        out.append(f"# TrainingJob {name}: attempt 1 (ownerReferences get the job's real uid when applied)\n")
        out.append(yaml.safe_dump_all(render(body), sort_keys=False, default_flow_style=False, explicit_start=True))
    return "".join(out)
