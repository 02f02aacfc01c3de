"""Every TrainingJob in examples/ applied to the real API server, as `kubectl apply -f` would (strict field
validation), with the objects it refers to (its claim, its Secret) and the CRDs its scheduling needs
(Volcano's PodGroup): the real `kubetron operator` creates its pods. The pods' files (tokenizers, HF
models, data on the claim) do not exist here, and need not: the trainer reads them, not the operator.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.cluster import collection_path, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("trainingjob-*.yaml"))
KIND = ("kubetron.dev/v1alpha1", "TrainingJob")
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
# Volcano's PodGroup as a cluster with Volcano installed serves it (the schema left open: the operator's
# PodGroup is what is under test, not Volcano's validation).
VOLCANO_PODGROUP = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "podgroups.scheduling.volcano.sh"},
    "spec": {"group": "scheduling.volcano.sh", "scope": "Namespaced",
             "names": {"kind": "PodGroup", "plural": "podgroups", "singular": "podgroup", "listKind": "PodGroupList"},
             "versions": [{"name": "v1beta1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def jobs() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in EXAMPLES for d in docs(p) if (d["apiVersion"], d["kind"]) == KIND]


def referenced(job: dict[str, Any]) -> set[tuple[str, str]]:
    """(kind, name) of the namespaced objects a job needs to exist: its claim or its S3 Secret."""
    storage = job["spec"]["storage"]
    if "pvc" in storage:
        return {("PersistentVolumeClaim", storage["pvc"]["claimName"])}
    return {("Secret", storage["s3"]["secretRef"]["name"])}


def in_namespace(obj: dict[str, Any], ns: str) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = ns
    return obj


@pytest.fixture(scope="module")
def volcano(kube, tmp_path_factory):
    """Volcano's PodGroup CRD for this module only (other tests check what happens without it)."""
    path = tmp_path_factory.mktemp("crds") / "volcano-podgroup.yaml"
    path.write_text(yaml.safe_dump(VOLCANO_PODGROUP))
    kube.cp.install_crd(path)
    yield
    crd = f"{CRDS}/{VOLCANO_PODGROUP['metadata']['name']}"
    kube.admin.delete(crd, ok=(404,))
    wait_for("the PodGroup CRD deleted", lambda: kube.admin.get(crd, ok=(404,)) is None, 60)


@pytest.fixture(scope="module")
def examples_ns(kube, volcano):
    """One namespace and one operator for every example (their names differ)."""
    ns = kube.namespace("examples")
    with kube.operator(ns) as op:
        yield ns
    assert "Traceback" not in op.log(), op.tail()


def test_every_example_file_is_covered():
    assert len(jobs()) == len(EXAMPLES) >= 7


@pytest.mark.parametrize("name, job", jobs(), ids=[n for n, _ in jobs()])
def test_example_applies_and_gets_its_pods(kube, examples_ns, name, job):
    ns, api = examples_ns, kube.admin
    own = docs(ROOT / "examples" / name)
    defined = {(d["kind"], d["metadata"]["name"]): d for p in EXAMPLES for d in docs(p)}
    needed = [defined[ref] for ref in sorted(referenced(job)) if ref not in {(d["kind"], d["metadata"]["name"])
                                                                             for d in own}]
    for obj in [*needed, *own]:  # the objects it refers to first, then the file in its order
        obj = in_namespace(obj, ns)
        api.create(collection_path(obj), obj, query={"fieldValidation": "Strict"}, ok=(409,))
    job_name, nodes = job["metadata"]["name"], job["spec"]["nodes"]
    want = {f"{job_name}-1-{rank}" for rank in range(nodes)}

    def pods() -> set[str] | None:
        have = {n for n, p in kube.pods(ns).items() if p["metadata"]["labels"].get("kubetron.dev/job") == job_name}
        return have if have == want else None

    def status() -> str:
        return f"{job_name} status: {(kube.job(ns, job_name) or {}).get('status')}"

    kube.wait_for(f"{name}: pods {sorted(want)}", pods, explain=status)
    st = kube.wait_status(ns, job_name, "attempt 1", lambda s: s.get("attempt") == 1)
    assert st["phase"] == "Pending", st
