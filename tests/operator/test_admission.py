"""What the operator checks before any pod exists (Job.from_body -> ConfigContainer.derive), and what it
leaves to the trainer: the config's schema, types and world-size arithmetic are the operator's; the
pod's files, S3 objects and environment are the trainer's (ConfigContainer.resolve at start), because
the operator has none of them.

Every admission below runs under an audit hook that fails the test on any file opened, directory listed,
socket connected or process started, with hostile KUBETRON_* and AWS variables in the environment.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from kubetron.config import ConfigContainer
from kubetron_operator.model import Job, SpecError

from tests.operator.jobs import PVC_JOB, S3_JOB

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
_WATCHED = ("open", "os.listdir", "os.scandir", "socket.connect", "socket.getaddrinfo", "subprocess.Popen")
_reads: list[tuple[str, tuple]] | None = None
_thread: int | None = None  # only the admitting thread: other tests' watch threads may share this process


def _audit(event: str, args: tuple) -> None:
    if _reads is not None and event in _WATCHED and threading.get_ident() == _thread:
        _reads.append((event, args))


sys.addaudithook(_audit)  # stays for the process (hooks cannot be removed); records only inside no_io()


@contextlib.contextmanager
def no_io():
    """Fail if the block opens a file, lists a directory, connects a socket or starts a process."""
    global _reads, _thread
    _reads, _thread = [], threading.get_ident()
    try:
        yield
    finally:
        seen, _reads = _reads, None
    assert not seen, f"admission touched the outside world: {seen[:5]}"


@pytest.fixture(autouse=True)
def hostile_env(monkeypatch):
    """What the operator's own environment holds must not matter: no credentials, an S3 endpoint
    nothing listens on, KUBETRON_* values the trainer would refuse."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("KUBETRON_EXPECTED_ITERATION", "not-a-number")
    monkeypatch.setenv("KUBETRON_STATUS_PORT", "99999")
    real = importlib.util.find_spec  # the operator's image lacks the trainer's optional packages
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))


def merged(section: str) -> str:
    """BASE with `section`'s keys laid over it, as YAML."""
    data = yaml.safe_load(BASE)
    for key, value in yaml.safe_load(section).items():
        data[key] = {**data.get(key, {}), **value}
    return yaml.safe_dump(data)


def job(config: str, base: dict = PVC_JOB, **spec) -> dict:
    body = copy.deepcopy(base)
    body["spec"]["config"] = config
    body["spec"].update(spec)
    return body


BASE = "train: {train_iters: 10}\nmodel: {num_layers: 2}\n"
ON_THE_POD = [
    ("hf-tokenizer-dir-on-the-claim",
     "tokenizer: {tokenizer_type: HuggingFaceTokenizer, tokenizer_model: /ckpt/hf/llama}\n"),
    ("hf-tokenizer-on-s3", "tokenizer: {tokenizer_type: HuggingFaceTokenizer, tokenizer_model: s3://models/llama}\n"),
    ("sentencepiece-file", "tokenizer: {tokenizer_type: SentencePieceTokenizer, tokenizer_model: /ckpt/tok.model}\n"),
    ("gpt2-files-on-s3", "tokenizer: {tokenizer_type: GPT2BPETokenizer, vocab_file: s3://t/vocab.json, "
                         "merge_file: s3://t/merges.txt}\n"),
    ("file-tokenizer-with-vocab-size",
     "tokenizer: {tokenizer_type: HuggingFaceTokenizer, tokenizer_model: /ckpt/hf/llama}\nmodel: {vocab_size: 512}\n"),
    ("hf-pretrained-dir", "checkpoint: {pretrained_checkpoint: /ckpt/hf/llama}\n"),
    ("lora-on-an-hf-dir", "checkpoint: {pretrained_checkpoint: /ckpt/hf/llama}\npeft: {scheme: lora}\n"),
    ("indexed-data-on-the-claim", "dataset: {data_path: [/ckpt/data/corpus]}\n"),
    ("per-split-data-on-s3", "dataset: {train_data_path: [s3://d/train], valid_data_path: [s3://d/valid]}\n"),
    ("sft-jsonl-on-the-claim", "finetuning: {data_path: /ckpt/data/sft.jsonl}\n"),
    ("sft-shards-on-s3", "finetuning: {data_path: [s3://d/sft/train-*.parquet, s3://d/more.jsonl.zst]}\n"),
    ("tensorboard-on-the-claim", "logger: {tensorboard_dir: /ckpt/tb}\n"),
    ("wandb-in-the-trainer-image", "logger: {wandb_project: team-a}\n"),
]


@pytest.mark.parametrize("base", [PVC_JOB, S3_JOB], ids=["pvc-store", "s3-store"])
@pytest.mark.parametrize("name, section", ON_THE_POD, ids=[c[0] for c in ON_THE_POD])
def test_a_job_naming_the_pods_files_is_admitted_without_reading_them(base, name, section):
    with no_io():
        Job.from_body(job(merged(section), base, mode="finetune"))


def test_a_file_tokenizer_leaves_the_vocabulary_to_the_trainer():
    """derive() pads a byte tokenizer's vocabulary (no file) and leaves a file tokenizer's to resolve()."""
    with no_io():
        byte = ConfigContainer.from_dict(yaml.safe_load(BASE)).derive(world_size=4)
        hf = ConfigContainer.from_dict(yaml.safe_load(merged(ON_THE_POD[0][1]))).derive(world_size=4)
    assert byte.model.vocab_size == 384 and byte.data_parallel_size == 4
    assert hf.model.vocab_size is None and hf.data_parallel_size == 4
    assert hf.checkpoint.expected_resume_iteration is None and hf.train.status_port is None  # env unread


# What only the config and the world size decide is still refused at admission, naming the field.
REFUSED = [
    ("world-not-divisible-by-tp", "model: {num_attention_heads: 4, tensor_model_parallel_size: 4}\n",
     "model.tensor_model_parallel_size"),
    ("gbs-not-divisible-by-dp", "train: {train_iters: 10, micro_batch_size: 3, global_batch_size: 9}\n",
     "train.global_batch_size"),
    ("byte-vocab-too-small", "model: {vocab_size: 200}\n", "model.vocab_size"),
    ("tokenizer-file-missing-its-key", "tokenizer: {tokenizer_type: HuggingFaceTokenizer}\n",
     "tokenizer.tokenizer_model"),
    ("sft-data-empty-list", "finetuning: {data_path: []}\n", "finetuning.data_path"),
    ("lora-without-base", "peft: {scheme: lora}\n", "checkpoint.pretrained_checkpoint"),
]


@pytest.mark.parametrize("name, section, field", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_the_config_alone_decides_is_refused_at_admission(name, section, field):
    with no_io(), pytest.raises(SpecError) as err:
        Job.from_body(job(merged(section), nodes=2))  # world size 2
    assert err.value.field == "spec.config" and err.value.message.startswith(field), err.value


def test_kubetron_render_renders_a_job_whose_tokenizer_is_on_the_claim(tmp_path):
    """`kubetron render FILE` parses the job as the operator does: no file of the pod's is needed."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(merged(ON_THE_POD[0][1]))))
    proc = subprocess.run([str(Path(sys.executable).with_name("kubetron")), "render", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    pods = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == ["gpt-1-0", "gpt-1-1"]
