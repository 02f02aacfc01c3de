"""The real `kubetron operator` on the real API server admits jobs whose files live where the trainer runs:
a tokenizer on the job's volume, a tokenizer on S3. The operator cannot read either (it has no claim, no
job credentials), so it must not try: the pods appear, and the trainer reads the files when it starts.
"""

from __future__ import annotations

import socketserver
import threading

import pytest

from tests.operator.jobs import tj

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

HF_ON_THE_CLAIM = """\
train: {train_iters: 40}
model: {num_layers: 2}
tokenizer: {tokenizer_type: HuggingFaceTokenizer, tokenizer_model: /ckpt/hf/llama}
finetuning: {data_path: /ckpt/data/sft.jsonl}
checkpoint: {pretrained_checkpoint: /ckpt/hf/llama}
"""
HF_ON_S3 = """\
train: {train_iters: 40}
model: {num_layers: 2}
tokenizer: {tokenizer_type: HuggingFaceTokenizer, tokenizer_model: s3://models/llama}
"""


class ConnectionCounter:
    """A TCP port that counts the connections made to it (and closes each at once)."""

    def __init__(self) -> None:
        counter = self
        self.count = 0

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                counter.count += 1

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_job_with_its_tokenizer_and_model_on_its_volume_gets_its_pods(kube, kube_ns):
    ns, api = kube_ns, kube.admin
    with kube.operator(ns) as op:
        api.create(kube.jobs(ns), tj(ns, mode="finetune", config=HF_ON_THE_CLAIM,
                                     storage={"pvc": {"claimName": "ckpt"}}))
        pods = kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
        st = kube.wait_status(ns, "gpt", "Pending attempt 1", lambda s: s.get("attempt") == 1)
        assert st["phase"] == "Pending", st
        assert all(p["spec"]["containers"][0]["args"][0] == "finetune" for p in pods.values())
    assert "Traceback" not in op.log(), op.tail()


def test_a_job_with_its_tokenizer_on_s3_gets_its_pods_and_the_operator_calls_no_s3(kube, kube_ns):
    """The operator's environment points AWS at a port that counts connections, with credentials that
    would be used: the tokenizer is the trainer's to read (with the job's Secret), so nothing connects."""
    ns, api = kube_ns, kube.admin
    endpoint = ConnectionCounter()
    env = {"AWS_ENDPOINT_URL": endpoint.url, "AWS_ACCESS_KEY_ID": "operator-key",
           "AWS_SECRET_ACCESS_KEY": "operator-secret", "AWS_REGION": "us-east-1"}
    try:
        with kube.operator(ns, env=env) as op:
            api.create(kube.jobs(ns), tj(ns, config=HF_ON_S3))
            kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"})
            st = kube.wait_status(ns, "gpt", "Pending attempt 1", lambda s: s.get("attempt") == 1)
            assert st["phase"] == "Pending", st
    finally:
        endpoint.close()
    assert endpoint.count == 0, f"the operator connected to its AWS_ENDPOINT_URL {endpoint.count} times"
    assert "Traceback" not in op.log(), op.tail()
