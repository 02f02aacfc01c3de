"""examples/chat-sft/run.sh as a user runs it (docs/finetuning.md), briefly: the tiny chat model is made, imported,
its data inspected (the tool call's turn trained), fine-tuned a few iterations on CPU, exported, and chatted with
through its chat template by transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.hf_utils import REPO

pytestmark = pytest.mark.process


def test_the_chat_example_runs_end_to_end(tmp_path):
    env = {**os.environ, "W": str(tmp_path / "w"), "PY": sys.executable, "ITERS": "2"}
    out = subprocess.run(["bash", "examples/chat-sft/run.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "examples/chat-sft/chats.jsonl: 48 examples; 0 cut at seq_length;" in out.stdout
    assert '<|im_start|>assistant\n⟦<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>⟧' in out.stdout
    assert "iteration        2/       2" in log
    tuned = tmp_path / "w" / "hf-tuned"
    assert (tuned / "chat_template.jinja").read_text() == (REPO / "examples" / "chat-sft" /
                                                           "chat_template.jinja").read_text()
    replies = [line for line in out.stdout.splitlines() if line.startswith("'") and " -> " in line]
    assert [r.split(" -> ")[0] for r in replies] == ["'What is the weather in Oslo?'"] * 2 + ["'What color is grass?'"]
