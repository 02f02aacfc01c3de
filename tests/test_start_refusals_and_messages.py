"""What a run says and where it says it, as a user meets it: which tokenizer made the data (refused when it is
not the run's), preprocess inputs it cannot read, a start from an empty checkpoint.load, a quiet console, the
termination message only inside a pod, and a model/checkpoint mismatch that is a config error from any kind of
checkpoint, found before the model is built."""

from __future__ import annotations

import json
import logging
import re
import struct
from pathlib import Path

import pytest

from tests.inprocess import command
from tests.trainer_utils import TINY, run

pytestmark = pytest.mark.trainer

SHORT = ["train.train_iters=2", "logger.log_interval=1", "validation.eval_interval=null", "validation.eval_iters=1",
         "scheduler.lr_warmup_iters=0", "checkpoint.save=null"]


def _docs(path: Path, n: int = 300) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i} about snow and grass, white and green."}) + "\n"
                            for i in range(n)))
    return path


def _bpe(out: Path) -> Path:
    """A small byte-level BPE tokenizer.json (trained here, no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["document about snow and grass, white and green."] * 50, trainer)
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


# --- item 6: which tokenizer made the data ----------------------------------------------------------------------

def test_data_made_by_another_tokenizer_is_refused_at_start_naming_both(tmp_path, capsys, caplog):
    """preprocess records its tokenizer beside the .bin/.idx; a run with another tokenizer (here: data made with
    the default byte tokenizer, trained with an HF one) stops at start, one line naming both, exit 2; with the
    tokenizer that made it the run starts; data without the record (older preprocess, megatron's tools) is read
    with a log line saying the tokenizer is not checked."""
    caplog.set_level(logging.INFO, logger="kubetron")
    assert command(capsys, "preprocess", "--input", str(_docs(tmp_path / "docs.jsonl")), "--output-prefix",
                   str(tmp_path / "data" / "docs"))[0] == 0
    record = json.loads((tmp_path / "data" / "docs.tokenizer.json").read_text())
    assert record["tokenizer_type"] == "byte" and record["vocab_size"] == 258
    data = [f"dataset.data_path=[{tmp_path / 'data' / 'docs'}]", "dataset.split=98,1,1"]
    hf = ["tokenizer.tokenizer_type=HuggingFaceTokenizer", f"tokenizer.tokenizer_model={_bpe(tmp_path / 'tok')}"]
    caplog.clear()
    code, _, err = command(capsys, "train", "--config", TINY, *SHORT, *data, *hf)
    assert code == 2, err[-2000:]
    line = err.strip()
    assert "\n" not in line and "dataset.data_path" in line and "byte (vocabulary 258" in line \
        and re.search(r"this run's tokenizer is HuggingFaceTokenizer \(vocabulary \d+", line), line
    assert "model:" not in caplog.text  # refused before the model was built
    (tmp_path / "data" / "docs.tokenizer.json").unlink()
    code, _, err = command(capsys, "train", "--config", TINY, *SHORT, *data)
    assert code == 0, err[-2000:]
    assert "no .tokenizer.json beside the data" in caplog.text and "not checked" in caplog.text


def test_preprocess_with_an_hf_tokenizer_then_train_with_it(tmp_path, capsys, caplog):
    """The record of an HF tokenizer matches the run's own: the same files give the same fingerprint."""
    caplog.set_level(logging.INFO, logger="kubetron")
    tok = _bpe(tmp_path / "tok")
    code, _, err = command(capsys, "preprocess", "--input", str(_docs(tmp_path / "docs.jsonl")), "--output-prefix",
                           str(tmp_path / "data" / "docs"), "--tokenizer-type", "HuggingFaceTokenizer",
                           "--tokenizer-model", str(tok))
    assert code == 0, err
    assert re.search(r"tokenizer HuggingFaceTokenizer of \d+ ids", err), err
    data = f"dataset.data_path=[{tmp_path / 'data' / 'docs'}]"
    code, _, err = command(capsys, "train", "--config", TINY, *SHORT, data, "dataset.split=98,1,1",
                           "tokenizer.tokenizer_type=HuggingFaceTokenizer",
                           f"tokenizer.tokenizer_model={tok / 'tokenizer.json'}")
    assert code == 0, err[-2000:]
    assert "not checked" not in caplog.text


def _parquet_like(path: Path) -> Path:
    """The first and last bytes of a Parquet file (magic PAR1), which byte-level reading turned into tokens."""
    path.write_bytes(b"PAR1" + bytes(range(256)) * 4 + struct.pack("<I", 1024) + b"PAR1")
    return path


def _arrow_stream_like(path: Path) -> Path:
    """datasets' save_to_disk shards are Arrow IPC streams: they start with the continuation marker."""
    path.write_bytes(b"\xff\xff\xff\xff" + bytes(range(256)) * 4)
    return path


@pytest.mark.parametrize("make,name,kind", [(_parquet_like, "data.parquet", "Parquet"),
                                            (_arrow_stream_like, "data-00000-of-00001.arrow", "Arrow stream"),
                                            (_parquet_like, "renamed.jsonl", "Parquet")])
def test_preprocess_never_reads_a_columnar_file_as_text(tmp_path, capsys, make, name, kind):
    """A file that starts like Parquet or Arrow (whatever its name) is read as columns, never as text: one
    pyarrow cannot read is refused in one line naming it, exit 2, and nothing is written. (Before, a .parquet
    or .arrow file was byte-tokenized as text, exit 0. A readable one: the next test.)"""
    src = make(tmp_path / name)
    code, _, err = command(capsys, "preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "out" / "x"))
    line = err.strip()
    assert code == 2 and "\n" not in line and f"{src}: cannot read it as {kind} data: " in line, line
    assert not list((tmp_path / "out").glob("x*"))


def test_preprocess_reads_the_text_column_of_parquet_and_arrow(tmp_path, capsys):
    """A Parquet file's and an Arrow stream's text column (--json-keys) gives the same documents as the JSONL
    of the same rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from kubetron.data.datasets import open_indexed

    rows = [f"document {i} about snow" for i in range(50)]
    table = pa.table({"id": list(range(50)), "content": rows})
    pq.write_table(table, tmp_path / "a.parquet")
    with pa.ipc.new_stream(str(tmp_path / "a.arrow"), table.schema) as w:
        w.write_table(table)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"content": r}) + "\n" for r in rows))
    out = {}
    for name in ("a.jsonl", "a.parquet", "a.arrow"):
        code, _, err = command(capsys, "preprocess", "--input", str(tmp_path / name), "--output-prefix",
                               str(tmp_path / f"out-{name}"), "--json-keys", "content")
        assert code == 0, err
        ds = open_indexed(str(tmp_path / f"out-{name}"))
        out[name] = [ds[i].tolist() for i in range(len(ds))]
    assert out["a.parquet"] == out["a.jsonl"] == out["a.arrow"] and len(out["a.jsonl"]) == 50
    code, _, err = command(capsys, "preprocess", "--input", str(tmp_path / "a.parquet"), "--output-prefix",
                           str(tmp_path / "b"))
    assert code == 2 and "no column 'text'" in err and "content" in err


@pytest.mark.parametrize("content", ["", "\n\n  \n", '{"text": ""}\n{"text": ""}\n'],
                         ids=["empty", "blank", "empty-texts"])
def test_preprocess_of_inputs_without_a_document_is_an_error(tmp_path, capsys, content):
    src = tmp_path / ("in.jsonl" if "text" in content else "in.txt")
    src.write_text(content)
    code, _, err = command(capsys, "preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "out" / "x"))
    line = err.strip().splitlines()[-1]
    assert code == 2 and "no documents" in line and str(src) in line, err
    assert not list((tmp_path / "out").glob("x*"))


# --- item 10: what a start says -----------------------------------------------------------------------------------

@pytest.mark.process
def test_a_start_from_an_empty_load_says_so_and_the_console_is_quiet(tmp_path):
    """checkpoint.load holding nothing: a line says the run starts from scratch. The config's non-default values
    are one line (at INFO), megatron's index-cache and TE/Apex notices are not printed, and the iteration time
    is printed once per log line."""
    from kubetron.cli import main

    assert main(["preprocess", "--input", str(_docs(tmp_path / "docs.jsonl")), "--output-prefix",
                 str(tmp_path / "docs")]) == 0
    (tmp_path / "empty").mkdir()
    p = run(["train", "--config", TINY, *SHORT, f"checkpoint.load={tmp_path / 'empty'}",
             f"dataset.data_path=[{tmp_path / 'docs'}]", "dataset.split=98,1,1"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout + p.stderr
    assert f"checkpoint.load={tmp_path / 'empty'} holds no checkpoint: starting at iteration 0 from freshly " \
           "initialized weights" in out
    assert len([ln for ln in out.splitlines() if "differ from the defaults" in ln or "(default " in ln]) == 1
    for noise in ("path_to_cache is None", "Transformer Engine and Apex", "Apex is not installed",
                  "time (ms, per iteration)"):
        assert noise not in out, noise
    assert len(re.findall(r"elapsed time per iteration \(ms\)", out)) == 2


# --- item 11: the termination message outside a pod ------------------------------------------------------------

def test_no_termination_message_outside_a_pod_unless_asked(tmp_path, monkeypatch):
    """/dev/termination-log (here a writable stand-in) is written only inside a pod (KUBERNETES_SERVICE_HOST);
    train.termination_log or KUBETRON_TERMINATION_LOG still name a file anywhere."""
    import kubetron.supervisor.termination_log as tl

    dev = tmp_path / "termination-log"
    dev.write_text("")
    monkeypatch.setattr(tl, "DEFAULT_TERMINATION_LOG", str(dev))
    monkeypatch.delenv("KUBETRON_TERMINATION_LOG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    message = {"exitCode": 2, "reason": "ConfigError", "message": "x"}
    assert not tl.write_termination_message(message) and dev.read_text() == ""
    assert tl.write_termination_message(message, str(tmp_path / "asked")) and (tmp_path / "asked").is_file()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert tl.write_termination_message(message) and json.loads(dev.read_text())["reason"] == "ConfigError"


# --- item 13: a model that does not match its checkpoint ---------------------------------------------------------

def test_a_shape_mismatch_is_a_config_error_from_an_hf_directory_and_a_checkpoint_before_the_build(
        tmp_path, capsys, caplog, monkeypatch):
    """The same mismatch (a run with 3 layers, a checkpoint with 2) from an HF directory and from the import of
    it: exit 2 (ConfigError, not retried in a pod) naming the field, before the model is built."""
    pytest.importorskip("transformers")
    from tests.hf_utils import finetune_args, imported_model_keys, make_tiny_llama

    caplog.set_level(logging.INFO, logger="kubetron")
    hf = make_tiny_llama(tmp_path / "hf")
    code, _, err = command(capsys, "import-hf", str(hf), str(tmp_path / "ckpt"))
    assert code == 0, err
    (tmp_path / "sft.jsonl").write_text(json.dumps({"input": "a", "output": "b"}) + "\n")
    keys = {**imported_model_keys(tmp_path / "ckpt"), "num_layers": 3}
    for source in (hf, tmp_path / "ckpt"):
        termination = tmp_path / f"termination-{source.name}"
        monkeypatch.setenv("KUBETRON_TERMINATION_LOG", str(termination))
        caplog.clear()
        code, _, err = command(capsys, *finetune_args(tmp_path / source.name, tmp_path / "sft.jsonl", source, keys, 1))
        assert code == 2, (source, code, err[-2000:])
        line = err.strip().splitlines()[-1]
        assert "model.num_layers" in line and "2" in line and "3" in line, line
        assert json.loads(termination.read_text())["reason"] == "ConfigError"
        assert "model:" not in caplog.text  # no model was built
