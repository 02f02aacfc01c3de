"""Fine-tuning data: templates, files and scripts that were refused, mis-rendered or hung, each with its test; what
is dropped at seq_length; and `kubetron inspect-data` as a user runs it."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest
from kubetron.data.finetuning import FinetuningDataset
from kubetron.data.sft.encode import Encoder
from kubetron.data.sft.rows import RowKeys, parse_row
from kubetron.data.tokenizer import ByteTokenizer, tokenizer_from_assets

from tests.chat_tokenizers import (
    MISTRAL_V3_TEMPLATE,
    deepseek_tokenizer,
    mistral_tokenizer,
    qwen25_tokenizer,
    trl_template,
    write_jsonl,
)
from tests.hf_utils import REPO
from tests.sft_rows import SHAPES, kubetron_example

pytestmark = pytest.mark.unit


def _trained(hf, ids, mask) -> list[str]:
    runs, start = [], None
    for j, m in enumerate([*mask, 0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            runs.append(hf.decode(ids[start:j]))
            start = None
    return runs


def test_a_deepseek_r1_template_trains_the_answer_after_think(tmp_path):
    """DeepSeek-R1's template drops the reasoning (up to </think>) from a turn it re-renders: the row trains, with
    transformers' ids, on what the template writes after <｜Assistant｜> - the answer with the blank line it keeps -
    through the end of the turn (was: the dataset refused)."""
    from transformers import AutoTokenizer

    path = deepseek_tokenizer(tmp_path / "r1", trl_template("deepseek_r1_distill"))
    tok, hf = tokenizer_from_assets("HuggingFaceTokenizer", str(path)), AutoTokenizer.from_pretrained(path)
    row = SHAPES["reasoning-in-content"]
    ids, mask = kubetron_example(tok, row)
    assert ids == hf.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert _trained(hf, ids, mask) == ["\n\n10<｜end▁of▁sentence｜>", "\n\n144<｜end▁of▁sentence｜>"]


def test_tool_call_arguments_from_parquet_are_the_rows_own(tmp_path):
    """Parquet gives every row's arguments struct every key of every row (null where it had none): they are dropped,
    so each row renders as its JSON line does (was: the other rows' keys rendered as null)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(name, args):
        return {"messages": [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}}]}]}

    rows = [row("get_weather", {"city": "Paris"}), row("search", {"query": "snow", "limit": 3})]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "calls.parquet")
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(qwen25_tokenizer(tmp_path / "q")))
    from_table = FinetuningDataset(str(tmp_path / "calls.parquet"), tok, 256, packing=False, seed=0, shuffle=False)
    from_lines = FinetuningDataset(str(write_jsonl(tmp_path / "calls.jsonl", rows)), tok, 256, packing=False, seed=0,
                                   shuffle=False)
    assert from_table.tokens.tolist() == from_lines.tokens.tolist()
    assert "null" not in tok.decode_all(from_table.tokens) and '{"city": "Paris"}' in tok.decode_all(from_table.tokens)


NO_GUARD = """
import json, sys
from kubetron.data.finetuning import SftSettings, build_arrays
from kubetron.data.tokenizer import ByteTokenizer
arrays, counts = build_arrays(sys.argv[1], ByteTokenizer(), SftSettings(64, True), "finetuning.data_path")
print("BUILT", counts["rows"])
"""


@pytest.mark.process
def test_a_script_without_a_main_guard_builds_on_all_cores(tmp_path):
    """build_arrays called at a script's top level with more than one batch of rows: the workers are kubetron's own
    processes, which never import the script, so it builds on all cores once (was: a hang, or the script run again
    in every worker)."""
    from kubetron.data.sft import encode

    data = write_jsonl(tmp_path / "d.jsonl", [{"input": f"{i}+{i}=", "output": str(2 * i)}
                                               for i in range(encode.BATCH * 2 + 1)])
    (tmp_path / "script.py").write_text(NO_GUARD)
    out = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(data)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(REPO / "trainer"), "PATH": "/usr/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("BUILT") == 1 and f"BUILT {encode.BATCH * 2 + 1}" in out.stdout
    assert "failed" not in out.stderr and "Traceback" not in out.stderr


def test_a_row_without_an_assistant_turn_names_the_roles_it_has():
    with pytest.raises(ValueError, match=r"has no assistant message to learn from \(roles: 'user', 'bot'; the turns "
                                         r"trained on are role 'assistant' with content or tool_calls\)"):
        parse_row({"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}, RowKeys())


def test_mistral_dropping_the_system_prompt_is_said(tmp_path, caplog):
    """Mistral v0.3's template writes the system message only when the conversation ends with a user turn, so a
    training chat loses it: a warning counts the chats (transformers renders the same, silently)."""
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(mistral_tokenizer(tmp_path / "m", MISTRAL_V3_TEMPLATE)))
    chat = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour"}]
    with caplog.at_level(logging.WARNING, logger="kubetron"):
        FinetuningDataset(str(write_jsonl(tmp_path / "s.jsonl", [{"messages": chat}] * 3 + [
            {"messages": chat[1:]}])), tok, 128, packing=True, seed=0)
    assert "the chat template leaves out the system message of 3 of the 4 examples" in caplog.text


def test_examples_with_nothing_to_train_after_the_cut_are_dropped_and_counted(caplog):
    """An example whose answer starts past seq_length is dropped (TRL drops it too), counted in the data line; when
    none is left the build is refused in one line naming model.seq_length (was: loss 0, exit 0)."""
    rows = [("short?", "yes"), ("x" * 40 + "?", "no"), ("y" * 20 + "?", "a long answer that is cut")]
    items = [(f"d.jsonl:{n}", parse_row({"input": q, "output": a}, RowKeys())) for n, (q, a) in enumerate(rows, 1)]
    encoded = Encoder(ByteTokenizer(), 24, True, None, "finetuning.data_path").encode(items)
    assert (encoded.dropped_cut, encoded.cut, encoded.kept_rows) == (1, 1, [0, 2])
    from kubetron.data.finetuning import data_line

    line = data_line("d.jsonl", {"rows": 3, "dropped": 1, "dropped_cut": 1, "cut": 1, "trained_tokens": 7}, 2, 24,
                     True, 30)
    assert line.startswith("d.jsonl: 2 examples; 1 dropped with nothing to train (1 after the cut at seq_length); "
                           "1 cut at seq_length; 7 trained tokens; in 2 sequences of 24")


INSPECT = """\
model: {num_layers: 1, hidden_size: 32, num_attention_heads: 2, seq_length: 1024}
train: {train_iters: 1}
tokenizer: {tokenizer_type: HuggingFaceTokenizer, tokenizer_model: TOK}
finetuning: {data_path: DATA, packing: true}
"""


@pytest.mark.process
def test_inspect_data_shows_the_ids_and_masks_the_trainer_trains_on(tmp_path):
    """`kubetron inspect-data --config FILE [overrides] --json`: one object per example with the ids and loss mask the
    build makes (tool calls included), the data line on stderr; the text form marks the trained spans; an
    all-truncated dataset is exit 2, one line naming model.seq_length."""
    from kubetron.config import ConfigContainer
    from kubetron.data import inspect

    tok_dir = qwen25_tokenizer(tmp_path / "q")
    rows = [SHAPES["tool-call-content-null"], SHAPES["parallel-calls"], SHAPES["one-turn"]]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    (tmp_path / "run.yaml").write_text(INSPECT.replace("TOK", str(tok_dir)).replace("DATA", str(data)))
    cmd = [sys.executable, "-m", "kubetron", "inspect-data", "--config", str(tmp_path / "run.yaml")]
    out = subprocess.run([*cmd, "--json", "--limit", "2", "finetuning.packing=false"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shown = [json.loads(line) for line in out.stdout.splitlines()]
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    assert [(e["example"], e["row"], e["sequence"]) for e in shown] == [(1, f"{data}:1", 1), (2, f"{data}:2", 2)]
    for e, row in zip(shown, rows, strict=False):
        assert (e["ids"], e["loss_mask"]) == kubetron_example(tok, row)
    assert f"{data}: 3 examples; 0 cut at seq_length;" in out.stderr and "in 3 sequences of 1024 (padded;" in out.stderr
    refused = subprocess.run([*cmd, "model.seq_length=16"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("kubetron: error: model.seq_length: ") and refused.stderr.count("\n") == 1
    text = io.StringIO()
    cfg = ConfigContainer.from_yaml(str(tmp_path / "run.yaml"), [], check_paths=True)
    inspect.run(cfg, 1, False, out=text)
    call = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris"})})
    assert f"<|im_start|>assistant\n⟦<tool_call>\n{call}\n</tool_call><|im_end|>⟧\n" in text.getvalue()
    assert "⟦The weather in Paris is sunny, 21 C.<|im_end|>⟧" in text.getvalue()
