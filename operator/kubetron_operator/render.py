"""`kubetron render trainingjob.yaml`: the manifests the operator would create for attempt 1."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from kubetron.contract.errors import ConfigError
from kubetron.contract.resource import API_VERSION, KIND

from kubetron_operator.build import build
from kubetron_operator.model import Job, SpecError

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"  # the API server assigns the real one


def render(body: Mapping[str, Any], attempt: int = 1) -> list[dict[str, Any]]:
    """Manifests for one TrainingJob body (raises model.SpecError on an invalid spec)."""
    meta = dict(body.get("metadata") or {})
    meta.setdefault("uid", PLACEHOLDER_UID)
    return build(Job.from_body({**body, "metadata": meta}), attempt)


def render_file(path: str) -> str:
    """YAML (multi-document) of every TrainingJob in `path`, attempt 1; an invalid spec is a ConfigError
    (one line naming the file and field, exit code 2), as the operator would fail the job."""
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    jobs = [d for d in docs if d.get("kind") == KIND and d.get("apiVersion") == API_VERSION]
    if not jobs:
        raise ValueError(f"{path}: no {API_VERSION} {KIND} found")
    out = []
    for body in jobs:
        name = (body.get("metadata") or {}).get("name")
        out.append(f"# TrainingJob {name}: attempt 1 (ownerReferences get the job's real uid when applied)\n")
        try:
            manifests = render(body)
        except SpecError as exc:
            raise ConfigError(f"{path}: {exc.field}", exc.message) from None
        out.append(yaml.safe_dump_all(manifests, sort_keys=False, default_flow_style=False, explicit_start=True))
    return "".join(out)
