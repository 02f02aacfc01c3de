"""Fine-tuning data is tokenized and packed once (its tokenizer travels with the checkpoint): rank 0 builds it
and stores it in the job's store, every other rank and every restart loads it; a changed input is another key, a
damaged or unsigned cache is rebuilt (and never unpickled, even signed); long work logs progress with an ETA; a run
through the CLI keeps the tokenizer's files, chat templates included, verbatim in every checkpoint."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kubetron.contract.errors import ConfigError
from kubetron.data.finetuning import FinetuningDataset
from kubetron.data.sft import cache as sft_cache
from kubetron.data.tokenizer import tokenizer_from_assets

from tests.chat_tokenizers import (
    CHATS,
    LLAMA32_TEMPLATE,
    QWEN3_TEMPLATE,
    llama3_tokenizer,
    qwen3_tokenizer,
    sample_digest,
    write_jsonl,
)
from tests.hf_utils import REPO, imported_model_keys, make_tiny_llama, run_cli

pytestmark = pytest.mark.process

ROWS = [{"messages": c} for c in CHATS] * 20


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return qwen3_tokenizer(tmp_path_factory.mktemp("tok") / "q")


def _no_tokenizing(*_a, **_k):
    raise AssertionError("tokenized although the cache holds the data")


def _place(cache_dir) -> sft_cache.CachePlace:
    """The cache dir, shared by the ranks, with the job's key in a store beside it."""
    return sft_cache.CachePlace(str(cache_dir), True, str(cache_dir.parent / "store"))


def _dataset(data, tok, cache_dir, seq=128):
    return FinetuningDataset(str(data), tok, seq, packing=True, seed=0, cache_at=_place(cache_dir))


def test_built_once_then_loaded_without_tokenizing(tok_dir, tmp_path, monkeypatch, caplog):
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    (tmp_path / "data").mkdir()
    data = write_jsonl(tmp_path / "data" / "sft.jsonl", ROWS)
    before = sorted(os.listdir(tmp_path / "data"))
    with caplog.at_level(logging.INFO, logger="kubetron"):
        first = _dataset(data, tok, tmp_path / "cache")
    assert "stored in" in caplog.text
    stored = list((tmp_path / "cache").iterdir())
    assert len(stored) == 1 and stored[0].suffix == ".sftcache"
    assert sorted(os.listdir(tmp_path / "data")) == before  # nothing written next to the data
    caplog.clear()
    monkeypatch.setattr("kubetron.data.finetuning.encode_all", _no_tokenizing)
    with caplog.at_level(logging.INFO, logger="kubetron"):
        again = _dataset(data, tok, tmp_path / "cache")
    assert f"loaded from {tmp_path / 'cache'}/{stored[0].name}" in caplog.text
    assert sample_digest(again) == sample_digest(first)


def test_another_input_is_another_key(tok_dir, tmp_path):
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    data = write_jsonl(tmp_path / "sft.jsonl", ROWS)
    cache = tmp_path / "cache"
    a = sample_digest(_dataset(data, tok, cache))
    _dataset(data, tok, cache, seq=96)  # another seq_length
    other = qwen3_tokenizer(tmp_path / "other", QWEN3_TEMPLATE.replace("<|im_start|>", "<|im_start|> "))
    _dataset(data, tokenizer_from_assets("HuggingFaceTokenizer", str(other)), cache)  # another template
    write_jsonl(data, ROWS[:-1])  # the data changed
    b = sample_digest(_dataset(data, tok, cache))
    assert len(list(cache.iterdir())) == 4 and a != b


def test_a_damaged_or_foreign_cache_is_rebuilt_never_unpickled(tok_dir, tmp_path, caplog):
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    data = write_jsonl(tmp_path / "sft.jsonl", ROWS)
    good = sample_digest(_dataset(data, tok, tmp_path / "cache"))
    (path,) = (tmp_path / "cache").iterdir()
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])  # a partial write
    with caplog.at_level(logging.WARNING, logger="kubetron"):
        assert sample_digest(_dataset(data, tok, tmp_path / "cache")) == good
    assert "is not written by this job" in caplog.text and "rebuilding it" in caplog.text
    caplog.clear()
    job_key = sft_cache.job_secret(_place(tmp_path / "cache").key_store, True, "test")
    head = len(sft_cache.MAGIC) + 32
    marker = tmp_path / "unpickled"
    payload = np.array([_Boom(str(marker))], dtype=object)
    buf = io.BytesIO()
    np.savez(buf, **dict.fromkeys(("tokens", "flags", "offsets", "groups", "group_offsets", "meta"), payload))
    signed = hmac.new(job_key, buf.getvalue(), hashlib.sha256).digest()
    path.write_bytes(sft_cache.MAGIC + signed + buf.getvalue())  # even a signed cache is never unpickled
    with caplog.at_level(logging.WARNING, logger="kubetron"):
        assert sample_digest(_dataset(data, tok, tmp_path / "cache")) == good
    assert not marker.exists() and "is unreadable" in caplog.text and "rebuilding it" in caplog.text
    caplog.clear()
    with np.load(io.BytesIO(path.read_bytes()[head:]), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["tokens"][0] = 10**6  # an id outside the vocabulary
    meta = json.loads(arrays.pop("meta").tobytes())
    path.write_bytes(sft_cache.to_bytes(arrays, meta["key"], meta, job_key))
    with caplog.at_level(logging.WARNING, logger="kubetron"):
        assert sample_digest(_dataset(data, tok, tmp_path / "cache")) == good
    assert "token ids outside the vocabulary" in caplog.text


class _Boom:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


RANK1 = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from kubetron.data import finetuning
from kubetron.contract.errors import ConfigError
from kubetron.data.finetuning import FinetuningDataset
from kubetron.data.tokenizer import tokenizer_from_assets
from tests.chat_tokenizers import sample_digest

def no_tokenizing(*_a, **_k):
    raise AssertionError("rank 1 tokenized")

finetuning.encode_all = no_tokenizing
tok = tokenizer_from_assets("HuggingFaceTokenizer", sys.argv[1])
from kubetron.data.sft.cache import CachePlace
ds = FinetuningDataset(sys.argv[2], tok, 128, packing=True, seed=0, cache_at=CachePlace(sys.argv[3], True, sys.argv[4]))
print("DIGEST", sample_digest(ds))
"""


def test_other_ranks_wait_for_rank_0_and_load_its_build(tok_dir, tmp_path, monkeypatch):
    """Rank 1 (another process, started first) waits until rank 0 has stored the data, then loads it: it never
    tokenizes (its tokenizing is made to fail), and serves the same samples."""
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    data = write_jsonl(tmp_path / "sft.jsonl", ROWS)
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "PYTHONPATH": str(REPO)}
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1, str(tok_dir), str(data), str(tmp_path / "cache"),
                              _place(tmp_path / "cache").key_store],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        monkeypatch.setenv("RANK", "0")
        built = sample_digest(_dataset(data, tok, tmp_path / "cache"))
        out, _ = rank1.communicate(timeout=120)
    finally:
        rank1.kill()
    assert rank1.returncode == 0, out
    assert f"DIGEST {built}" in out and "loaded from" in out


def test_long_work_logs_progress_with_an_eta(tok_dir, tmp_path, monkeypatch, caplog):
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    data = write_jsonl(tmp_path / "sft.jsonl", ROWS * 60)
    monkeypatch.setattr("kubetron.data.sft.encode.PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr("kubetron.data.sft.encode.BATCH", 256)
    with caplog.at_level(logging.INFO, logger="kubetron"):
        FinetuningDataset(str(data), tok, 128, packing=True, seed=0)
    lines = [r.getMessage() for r in caplog.records if "tokenizing:" in r.getMessage()]
    assert lines and all("of 3600 examples" in x and "ETA " in x and "/s" in x for x in lines), lines


def test_finetune_on_chats_keeps_the_templates_in_every_checkpoint_and_restarts_from_the_cache(tmp_path):
    """The user's path: an HF Llama directory saved by transformers (named templates too), chats in Parquet,
    `kubetron finetune` with a checkpoint store; each iter_N/tokenizer/ holds the tokenizer's files verbatim, the
    tokenized data is stored once in the store, and the resumed run loads it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    hf = make_tiny_llama(tmp_path / "llama")
    tok_dir = llama3_tokenizer(tmp_path / "tok", {"default": LLAMA32_TEMPLATE, "tool_use": LLAMA32_TEMPLATE + "\n"})
    source = {p.relative_to(tok_dir).as_posix(): p.read_bytes() for p in tok_dir.rglob("*") if p.is_file()}
    assert {"chat_template.jinja", "additional_chat_templates/tool_use.jinja"} <= set(source)
    for name, data in source.items():  # the model directory as transformers saves model and tokenizer
        (hf / name).parent.mkdir(exist_ok=True)
        (hf / name).write_bytes(data)
    imported = run_cli(["import-hf", str(hf), str(tmp_path / "ckpt")], tmp_path)
    assert imported.returncode == 0, imported.stderr
    pq.write_table(pa.Table.from_pylist(ROWS * 10), tmp_path / "chats.parquet")  # batches for 2 worker processes
    keys = imported_model_keys(tmp_path / "ckpt")
    store = tmp_path / "run"

    def finetune(iters: int):
        model = [f"model.{k}={json.dumps(v)}" for k, v in keys.items() if k != "seq_length"]
        return run_cli(["finetune", *model, "model.seq_length=64", f"train.train_iters={iters}",
                        "train.micro_batch_size=2", "train.global_batch_size=2", "optimizer.lr=1e-3",
                        "validation.eval_interval=null", f"finetuning.data_path={tmp_path / 'chats.parquet'}",
                        "finetuning.packing=true", "tokenizer.tokenizer_type=HuggingFaceTokenizer",
                        f"tokenizer.tokenizer_model={hf}", f"checkpoint.pretrained_checkpoint={tmp_path / 'ckpt'}",
                        f"checkpoint.save={store}", f"checkpoint.load={store}", "checkpoint.save_interval=2",
                        "logger.log_interval=1", "train.exit_signal_handler=false"], tmp_path)

    first = finetune(2)
    assert first.returncode == 0, first.stderr[-3000:]
    log = first.stdout + first.stderr
    assert "trained tokens; in " in log and f"stored in {store}/sft_cache/" in log
    saved = store / "iter_0000002" / "tokenizer"
    assert {p.relative_to(saved).as_posix(): p.read_bytes() for p in saved.rglob("*") if p.is_file()} == source
    second = finetune(4)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"loaded from {store}/sft_cache/" in second.stdout + second.stderr
    assert (store / "iter_0000004" / "tokenizer" / "additional_chat_templates" / "tool_use.jinja").read_bytes() == \
        source["additional_chat_templates/tool_use.jinja"]


def test_all_cores_give_the_same_ids_as_one_process_and_name_a_bad_row(tok_dir, tmp_path):
    """Batches tokenized by worker processes (spawned, one per core) come back in order, equal to one process's;
    a template error inside a worker is the same one line naming the row."""
    from kubetron.data.sft import encode
    from kubetron.data.sft.rows import RowKeys, parse_row

    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    rows = ROWS * 40 + [{"input": "2+2=", "output": "4"}] * 100
    items = [(f"f:{n}", parse_row(r, RowKeys())) for n, r in enumerate(rows, 1)]
    settings = (64, True, None, "finetuning.data_path")
    one, many = encode.encode_all(tok, settings, items, workers=1), encode.encode_all(tok, settings, items, workers=2)
    assert len(items) > 2 * encode.BATCH and many.cut > 0
    for k, v in one.arrays().items():
        np.testing.assert_array_equal(v, many.arrays()[k], err_msg=k)
    bad = qwen3_tokenizer(tmp_path / "bad", "{% if messages|length > 5 %}{{ raise_exception('too long') }}{% endif %}"
                                            "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(ConfigError, match=r"finetuning.data_path: f:3: the chat template failed: too long"):
        encode.encode_all(tokenizer_from_assets("HuggingFaceTokenizer", str(bad)), settings, items, workers=2)


def test_the_finetuning_keys_reach_the_data(tok_dir, tmp_path, caplog):
    """finetuning.cache_dir is where the data is stored (else <checkpoint.save>/sft_cache); finetuning.chat_template
    names the template (an unknown one is refused naming the key); lists of paths are accepted as data_path."""
    from kubetron.config import ConfigContainer
    from kubetron.data.finetuning import build_finetuning_datasets

    data = write_jsonl(tmp_path / "sft.jsonl", ROWS)

    def datasets(**finetuning):
        cfg = ConfigContainer.from_dict({
            "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 64},
            "train": {"train_iters": 1}, "checkpoint": {"save": str(tmp_path / "store")},
            "tokenizer": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tok_dir)},
            "finetuning": {"data_path": [str(data), str(data)], "packing": True, **finetuning}})
        cfg = cfg.finalize(world_size=1, check_paths=True)
        return build_finetuning_datasets(cfg, tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir)))

    with caplog.at_level(logging.INFO, logger="kubetron"):
        by_default = datasets()["train"]
    assert len(list((tmp_path / "store" / "sft_cache").glob("*.sftcache"))) == 1
    assert by_default.offsets.size - 1 == 2 * len(ROWS)  # both paths of the list were read
    chosen = datasets(cache_dir=str(tmp_path / "elsewhere"))["train"]
    assert len(list((tmp_path / "elsewhere").glob("*.sftcache"))) == 1
    assert sample_digest(chosen) == sample_digest(by_default)
    with pytest.raises(ConfigError, match=r"finetuning.chat_template: 'chatml': the tokenizer has no chat template"):
        datasets(chat_template="chatml")
    with pytest.raises(ConfigError, match=r"finetuning.data_path: .*missing.jsonl: no such file or directory"):
        datasets(data_path=str(tmp_path / "missing.jsonl"))
