"""The examples/ manifests: every TrainingJob validates against the CRD's schema (as the API server
with kubectl's strict field validation would check it), the objects beside them (PVC, Secret) validate
against Kubernetes' own schemas, the trainer config inside each one is a valid ConfigContainer, and
what `kubetron render` makes of them is valid Kubernetes. Broken specs are rejected, naming the field.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "trainingjob.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("trainingjob-*.yaml"))
KUBE_VERSION = "1.27"  # the oldest the chart supports; its schemas are a subset of newer ones
CRD_KINDS = {("kubetron.dev/v1alpha1", "TrainingJob"),
             ("scheduling.volcano.sh/v1beta1", "PodGroup"), ("scheduling.x-k8s.io/v1alpha1", "PodGroup")}


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def strict(schema: dict) -> dict:
    """The CRD schema as the API server applies it with strict field validation (kubectl's default):
    an object's unknown fields are errors unless it preserves unknown fields or maps free-form keys."""
    schema = copy.deepcopy(schema)

    def walk(node: dict) -> None:
        if not isinstance(node, dict):
            return
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for child in (node.get("properties") or {}).values():
            walk(child)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key])
        for key in ("anyOf", "allOf", "oneOf"):
            for child in node.get(key, []):
                walk(child)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Validator:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    schema = strict(version["schema"]["openAPIV3Schema"])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


def error_text(validator: jsonschema.Validator, body: dict) -> str | None:
    """None when valid; else the best error as "field.path: message" (what `kubectl apply` names)."""
    error = jsonschema.exceptions.best_match(validator.iter_errors(body))
    if error is None:
        return None
    return ".".join(str(p) for p in error.absolute_path) + ": " + error.message


def training_jobs() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in EXAMPLES for doc in load(path) if doc["kind"] == "TrainingJob"]


def test_the_four_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"trainingjob-cpu.yaml", "trainingjob-pvc.yaml", "trainingjob-s3.yaml",
            "trainingjob-finetune.yaml"} <= names
    assert all(any(doc["kind"] == "TrainingJob" for doc in load(p)) for p in EXAMPLES)


@pytest.mark.parametrize("name, job", training_jobs(), ids=[n for n, _ in training_jobs()])
def test_example_training_job_validates_against_the_crd(validator, name, job):
    assert error_text(validator, job) is None
    assert job["apiVersion"] == "kubetron.dev/v1alpha1"


@pytest.mark.parametrize("name, job", training_jobs(), ids=[n for n, _ in training_jobs()])
def test_example_is_accepted_by_the_operator_and_the_trainer(name, job):
    """The operator's parser (checks the CRD cannot express) and the trainer's ConfigContainer."""
    model = pytest.importorskip("kubetron_operator.model")
    config = pytest.importorskip("kubetron.config")
    model.Job.from_body(job)
    config.ConfigContainer.from_dict(yaml.safe_load(job["spec"]["config"]))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_other_objects_in_examples_are_valid_kubernetes(path):
    kv = pytest.importorskip("kubernetes_validate.utils")
    for doc in load(path):
        if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS:
            kv.validate(doc, KUBE_VERSION, strict=True)


def test_references_inside_examples_resolve():
    """A job's PVC or Secret is either in the same file or created by an example it names."""
    defined = {(doc["kind"], doc["metadata"]["name"]) for p in EXAMPLES for doc in load(p)}
    for name, job in training_jobs():
        storage = job["spec"]["storage"]
        if "pvc" in storage:
            assert ("PersistentVolumeClaim", storage["pvc"]["claimName"]) in defined, name
        else:
            assert ("Secret", storage["s3"]["secretRef"]["name"]) in defined, name


def test_example_secret_holds_only_obvious_placeholders():
    (secret,) = [doc for doc in load(ROOT / "examples" / "trainingjob-s3.yaml") if doc["kind"] == "Secret"]
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for value in secret["stringData"].values():
        assert "example" in value.lower() or "replace" in value.lower()
        assert not value.startswith("AKIA")


# ---------------------------------------------------------------------------------- broken specs


def cpu_job() -> dict:
    (job,) = [doc for doc in load(ROOT / "examples" / "trainingjob-cpu.yaml") if doc["kind"] == "TrainingJob"]
    return job


def _set(body: dict, path: str, value) -> dict:
    body = copy.deepcopy(body)
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(last)
    else:
        node[last] = value
    return body


_DELETE = object()


@pytest.mark.parametrize("path, value, field", [
    ("spec.image", _DELETE, "image"),
    ("spec.nodes", 0, "spec.nodes"),
    ("spec.nodes", "2", "spec.nodes"),
    ("spec.gpusPerNode", -1, "spec.gpusPerNode"),
    ("spec.storage", {"pvc": {"claimName": "a"}, "s3": {"bucket": "b", "secretRef": {"name": "s"}}},
     "spec.storage"),
    ("spec.storage", {"s3": {"bucket": "bkt", "secretRef": {"name": "../../other/secrets/s"}}},
     "spec.storage.s3.secretRef.name"),  # a name that would climb out of the namespace in a request path
    ("spec.storage", {"s3": {"bucket": "b", "secretRef": {"name": "s"}}}, "spec.storage.s3.bucket"),
    ("spec.storage.pvc.mountPath", "ckpt", "spec.storage.pvc.mountPath"),
    ("spec.scheduling", {"gang": "kueue"}, "spec.scheduling.gang"),
    ("spec.mode", "rlhf", "spec.mode"),
    ("spec.overrides", ["train.train_iters"], "spec.overrides.0"),
    ("spec.gpuPerNode", 8, "gpuPerNode"),  # a typo: unknown fields are rejected, not dropped
    ("spec.backoffLimit", -1, "spec.backoffLimit"),
])
def test_broken_spec_is_rejected_naming_the_field(validator, path, value, field):
    message = error_text(validator, _set(cpu_job(), path, value))
    assert message is not None, f"{path}={value!r} was accepted"
    assert field in message, message


# ---------------------------------------------------------------------------- `kubetron render`


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_kubetron_render_output_is_valid_kubernetes(path, tmp_path):
    render = pytest.importorskip(
        "kubetron_operator.render", reason="kubetron_operator.render (kubetron render) does not exist yet")
    kv = pytest.importorskip("kubernetes_validate.utils")
    # render_file takes a TrainingJob manifest: give it the job alone, as a user would after the PVC
    # or Secret exists.
    (job,) = [doc for doc in load(path) if doc["kind"] == "TrainingJob"]
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    output = render.render_file(str(job_file))
    objects = [doc for doc in yaml.safe_load_all(output) if doc]
    assert any(o["kind"] == "Pod" for o in objects)
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) not in CRD_KINDS:
            kv.validate(obj, KUBE_VERSION, strict=True)


# ------------------------------------------------------------- the HF fine-tunes and their model


def _hf_finetune_configs(hf_dir: Path) -> dict[str, dict]:
    """The run configs of the examples that fine-tune examples/hf-sft's tiny Llama, pointed at `hf_dir`."""
    (job,) = [doc for doc in load(ROOT / "examples" / "trainingjob-hf-finetune.yaml") if doc["kind"] == "TrainingJob"]
    on_claim = job["spec"]["config"].replace("/ckpt/hf/tiny-llama", str(hf_dir))
    local = (ROOT / "examples" / "hf-sft" / "sft.yaml").read_text()
    return {"trainingjob-hf-finetune.yaml": yaml.safe_load(on_claim),
            "hf-sft/sft.yaml": yaml.safe_load(local.replace("/tmp/kubetron-hf-sft/hf", str(hf_dir)))}


@pytest.mark.process
def test_hf_finetune_examples_use_the_models_own_tokenizer_and_shape(tmp_path):
    """make_tiny_llama.py writes a model with its tokenizer; the examples that fine-tune it read that
    tokenizer from the model's directory, and their model section is what the HF config says."""
    pytest.importorskip("transformers")
    import subprocess
    import sys

    from kubetron.config import ConfigContainer
    from kubetron.data.tokenizer import build_tokenizer
    from kubetron.hf import config_map

    hf_dir = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, str(ROOT / "examples" / "hf-sft" / "make_tiny_llama.py"), str(hf_dir)],
                   check=True, capture_output=True, timeout=300)
    hf = config_map.read_hf_config(str(hf_dir))
    expected = {k: v for k, v in config_map.model_section(hf).items() if k != "seq_length"}
    for name, data in _hf_finetune_configs(hf_dir).items():
        assert data["tokenizer"] == {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(hf_dir)}, name
        cfg = ConfigContainer.from_dict(data).finalize(world_size=1, environ={}, check_paths=False)
        assert {k: getattr(cfg.model, k) for k in expected} == expected, name
        tok = build_tokenizer(cfg.tokenizer)
        assert (tok.eod, tok.pad) == (hf["eos_token_id"], hf["pad_token_id"]), name
        assert tok.vocab_size <= cfg.model.vocab_size, name
        assert tok.decode(tok.encode("What color is snow? white")) == "What color is snow? white"
