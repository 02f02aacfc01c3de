"""kubetron.data: tokenizer, preprocess, datasets, sampler order, prefetching iterator (CPU, fast)."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kubetron.contract.errors import ConfigError
from kubetron.data import datasets
from kubetron.data.datasets import (
    MockGPTDataset,
    build_gpt_datasets,
    parse_data_path,
    parse_split,
    split_ranges,
)
from kubetron.data.loader import (
    DataIterator,
    build_data_iterators,
    build_train_valid_test_data_iterators,
    split_sizes,
)
from kubetron.data.preprocess import iter_documents, preprocess
from kubetron.data.preprocess import main as preprocess_main
from kubetron.data.tokenizer import ByteTokenizer, NullTokenizer, build_tokenizer

pytestmark = pytest.mark.unit


def make_cfg(data_path=None, split="969,30,1", seq_length=32, mbs=2, gbs=8, dp=1, eval_interval=None, iters=50,
             **ds):
    dataset = {"data_path": data_path, "split": split, "pin_memory": False, "prefetch": 2, "mock_seed": None}
    dataset.update(ds)
    return SimpleNamespace(
        model=SimpleNamespace(seq_length=seq_length, vocab_size=384),
        train=SimpleNamespace(
            micro_batch_size=mbs, global_batch_size=gbs, num_microbatches=gbs // (mbs * dp), train_iters=iters
        ),
        dataset=SimpleNamespace(**dataset),
        rng=SimpleNamespace(seed=1234),
        tokenizer=SimpleNamespace(tokenizer_type="byte"),
        validation=SimpleNamespace(eval_interval=eval_interval, eval_iters=2),
    )


def take(it, n):
    return [next(it) for _ in range(n)]


def global_batches(cfg, dp, n_global, consumed=0, prefetch=2):
    """Run every dp rank for n_global global batches; return the samples of each global batch,
    in order, as one (gbs, T) tokens tensor per global batch (micro-batch by micro-batch, rank by rank)."""
    cfg.train.num_microbatches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    cfg.dataset.prefetch = prefetch
    its = [build_data_iterators(cfg, r, dp, train_consumed_samples=consumed)[0] for r in range(dp)]
    out = []
    for _ in range(n_global):
        parts = []
        for _ in range(cfg.train.num_microbatches):
            for it in its:
                parts.append(next(it)["tokens"])
        out.append(torch.cat(parts))
    consumed = {it.consumed_samples for it in its}
    for it in its:
        it.close()
    assert len(consumed) == 1
    return out, consumed.pop()


# ---------------------------------------------------------------------------------------------
# tokenizer


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("byte", None)
    assert isinstance(tok, ByteTokenizer)
    assert (tok.eod, tok.pad, tok.vocab_size) == (256, 257, 258)
    text = "héllo wörld ✓ \n tab\t"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eod, tok.pad]) == text
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    np.testing.assert_array_equal(tok.encode_np(text, append_eod=True), [*ids, 256])


def test_null_tokenizer_and_errors():
    tok = build_tokenizer("null", 1000)
    assert isinstance(tok, NullTokenizer)
    assert (tok.vocab_size, tok.eod) == (1000, 999)
    with pytest.raises(ConfigError) as e:
        build_tokenizer("null", None)
    assert e.value.field == "tokenizer.vocab_size"
    with pytest.raises(ConfigError) as e:
        build_tokenizer("gpt2bpe", None)
    assert e.value.field == "tokenizer.tokenizer_type"


# ---------------------------------------------------------------------------------------------
# mock data


def test_mock_dataset_deterministic_and_shaped():
    a, b = MockGPTDataset(64, 256, seed=7), MockGPTDataset(64, 256, seed=7)
    for i in (0, 1, 99, 10**12):
        sa, sb = a[i], b[i]
        assert set(sa) == {"tokens", "labels", "loss_mask", "position_ids"}
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k])
        assert sa["tokens"].shape == (64,) and sa["tokens"].dtype == np.int64
        assert sa["loss_mask"].dtype == np.float32 and sa["loss_mask"].all()
        np.testing.assert_array_equal(sa["labels"][:-1], sa["tokens"][1:])
        np.testing.assert_array_equal(sa["position_ids"], np.arange(64))
        assert 0 <= sa["tokens"].min() and sa["tokens"].max() < 256
    assert not np.array_equal(a[0]["tokens"], MockGPTDataset(64, 256, seed=8)[0]["tokens"])
    assert not np.array_equal(a[0]["tokens"], MockGPTDataset(64, 256, seed=7, salt=1)[0]["tokens"])
    distinct = {tuple(a[i]["tokens"][:4]) for i in range(100)}
    assert len(distinct) > 90
    # any length, any vocabulary
    big = MockGPTDataset(2048, 50_000, seed=1)[3]
    assert big["tokens"].shape == (2048,) and big["tokens"].max() < 50_000
    tiny = MockGPTDataset(5, 2, seed=1)[3]
    assert set(np.unique(tiny["tokens"])) <= {0, 1}


def test_mock_dataset_is_cheap():
    ds = MockGPTDataset(64, 256, seed=1)
    ds[0]
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        ds[i]
    per_sample = (time.perf_counter() - t0) / n
    assert per_sample < 1e-4, f"{per_sample * 1e6:.1f} us per sample"


def test_mock_samples_follow_a_rule():
    s = MockGPTDataset(64, 256, seed=3)[11]["tokens"]
    d = np.diff(s) % 256
    assert len(set(d.tolist())) == 1 and 1 <= d[0] <= 4


# ---------------------------------------------------------------------------------------------
# sampler order, data parallelism, resume, prefetch


def test_same_seed_same_batches():
    cfg = make_cfg()
    a, _ = build_data_iterators(cfg, 0, 1)
    b, _ = build_data_iterators(cfg, 0, 1)
    for x, y in zip(take(a, 10), take(b, 10)):
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(x[k], y[k])
    cfg2 = make_cfg()
    cfg2.rng.seed = 99
    c, _ = build_data_iterators(cfg2, 0, 1)
    assert not torch.equal(next(c)["tokens"], take(build_data_iterators(cfg, 0, 1)[0], 1)[0]["tokens"])
    for it in (a, b, c):
        it.close()


def test_batch_layout():
    cfg = make_cfg(seq_length=16, mbs=3, gbs=6)
    it, valid = build_data_iterators(cfg, 0, 1)
    valid.close()  # mock data has a validation split: evaluated after training even without eval_interval
    b = next(it)
    assert b["tokens"].shape == (3, 16) and b["tokens"].dtype == torch.int64
    assert b["labels"].dtype == torch.int64 and b["position_ids"].dtype == torch.int64
    assert b["loss_mask"].dtype == torch.float32 and b["attention_mask"] is None
    assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
    assert it.consumed_samples == 3 and it.state_dict() == {"consumed_samples": 3}
    it.close()


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_sizes_see_the_same_global_batches(dp):
    ref, consumed_ref = global_batches(make_cfg(mbs=1, gbs=8), 1, 3)
    got, consumed = global_batches(make_cfg(mbs=8 // (dp * 2), gbs=8), dp, 3)
    assert consumed == consumed_ref == 24
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_resume_at_a_different_dp_size(tmp_path):
    prefix = _write_corpus(tmp_path, "c", 60)
    cfg = lambda mbs: make_cfg(data_path=[prefix], split="1", seq_length=16, mbs=mbs, gbs=8)
    ref, _ = global_batches(cfg(2), 1, 6)
    first, consumed = global_batches(cfg(2), 2, 2)
    second, _ = global_batches(cfg(1), 4, 4, consumed=consumed)
    for r, g in zip(ref, first + second):
        assert torch.equal(r, g)


@pytest.mark.parametrize("prefetch", [0, 1, 4])
def test_resume_from_state_dict_gives_the_exact_continuation(prefetch):
    cfg = make_cfg(prefetch=prefetch, dp=2)
    it, _ = build_data_iterators(cfg, 1, 2)
    take(it, 5)
    time.sleep(0.05)  # let the prefetch thread run ahead
    state = it.state_dict()
    assert state == {"consumed_samples": 5 * 2 * 2}
    expected = take(it, 6)
    resumed, _ = build_data_iterators(cfg, 1, 2)
    resumed.load_state_dict(state)
    for x, y in zip(expected, take(resumed, 6)):
        assert torch.equal(x["tokens"], y["tokens"])
    # and through the constructor argument
    again, _ = build_data_iterators(cfg, 1, 2, train_consumed_samples=state["consumed_samples"])
    assert torch.equal(next(again)["tokens"], expected[0]["tokens"])
    # rewinding a running iterator
    it.load_state_dict(state)
    assert it.consumed_samples == 20
    assert torch.equal(next(it)["tokens"], expected[0]["tokens"])
    for x in (it, resumed, again):
        x.close()


def test_skip_microbatches():
    cfg = make_cfg()
    a, _ = build_data_iterators(cfg, 0, 1)
    b, _ = build_data_iterators(cfg, 0, 1)
    next(a)  # thread running
    a.skip_microbatches(3)
    take(b, 4)
    assert a.consumed_samples == b.consumed_samples == 8
    assert torch.equal(next(a)["tokens"], next(b)["tokens"])
    a.close()
    b.close()


def test_close_stops_the_daemon_thread():
    before = set(threading.enumerate())
    it = DataIterator(MockGPTDataset(32, 256), 2, prefetch=3)
    next(it)
    new = [t for t in threading.enumerate() if t not in before]
    assert len(new) == 1 and new[0].daemon
    time.sleep(0.05)  # queue full, producer blocked in put()
    it.close()
    assert not new[0].is_alive()
    with pytest.raises(RuntimeError):
        next(it)


def test_dataset_errors_surface_from_the_prefetch_thread():
    class Broken:
        def __getitem__(self, i):
            if i >= 4:
                raise ValueError(f"boom at {i}")
            return MockGPTDataset(8, 10)[i]

    it = DataIterator(Broken(), 2, prefetch=2)
    take(it, 2)
    with pytest.raises(ValueError, match="boom at 4"):
        next(it)
    assert it.consumed_samples == 4
    it.close()


def test_pin_memory_flag_is_harmless_without_cuda():
    it, _ = build_data_iterators(make_cfg(pin_memory=True), 0, 1)
    assert next(it)["tokens"].shape == (2, 32)
    it.close()


def test_batch_size_checks():
    with pytest.raises(ConfigError) as e:
        build_data_iterators(make_cfg(mbs=3, gbs=8), 0, 1)
    assert e.value.field == "train.global_batch_size"


def test_mock_validation_iterator_differs_from_train():
    train, valid = build_data_iterators(make_cfg(eval_interval=10), 0, 1, valid_consumed_samples=4)
    assert valid is not None and valid.consumed_samples == 4
    assert not torch.equal(next(train)["tokens"], next(valid)["tokens"])
    train.close()
    valid.close()


# ---------------------------------------------------------------------------------------------
# preprocess


DOCS_JSONL = ["first document", "zweites Dokument – ünïcödé ✓", "", "third\nwith a newline"]
TEXT_FILE = "para one line one\npara one line two\n\n\n  \npara two\n\npara three ✓\n"
TEXT_DOCS = ["para one line one\npara one line two", "para two", "para three ✓"]


def _read_docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return ds, [ds[i] for i in range(len(ds))]


def test_preprocess_round_trip(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS_JSONL)) + "\n\n")
    txt = tmp_path / "b.txt"
    txt.write_text(TEXT_FILE)
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"content": "gz doc"}) + "\n")
    logs = []
    out = preprocess([str(jl), str(txt)], str(tmp_path / "out" / "corpus"), log_interval=0, log=logs.append)
    expected = [d for d in DOCS_JSONL if d] + TEXT_DOCS
    assert out["documents"] == len(expected) and out["skipped_empty"] == 1 and out["files"] == 2
    assert out["tokens"] == sum(len(d.encode()) + 1 for d in expected)
    assert any("tokens/s" in line and "ETA" in line for line in logs) and "done" in logs[-1]
    ds, seqs = _read_docs(out["outputs"][0])
    assert ds.index.dtype == np.uint16
    tok = ByteTokenizer()
    assert [tok.decode(s) for s in seqs] == expected
    assert all(s[-1] == tok.eod for s in seqs)
    assert not list((tmp_path / "out").glob("*.tmp"))

    out = preprocess([str(gz)], str(tmp_path / "g"), append_eod=False, json_keys="content", log=logs.append)
    _, seqs = _read_docs(str(tmp_path / "g"))
    assert [tok.decode(s) for s in seqs] == ["gz doc"] and seqs[0][-1] != tok.eod


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "ok"}\n{"text": "ok"\n', "bad.jsonl:2: not valid JSON"),
        ('{"text": "ok"}\n\n{"body": "x"}\n', "bad.jsonl:3: no 'text' key"),
        ('{"text": 5}\n', "bad.jsonl:1: 'text' is a int"),
        ('["text"]\n', "bad.jsonl:1: expected a JSON object"),
    ],
)
def test_preprocess_bad_jsonl(tmp_path, content, match):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(ConfigError, match=match) as e:
        preprocess([str(bad)], str(tmp_path / "o"), log=lambda m: None)
    assert e.value.field in ("--input", "--json-keys")
    assert not list(tmp_path.glob("o*"))  # nothing half-written


def test_preprocess_missing_input(tmp_path, capsys):
    with pytest.raises(ConfigError, match="nope.jsonl: no such file") as e:
        preprocess([str(tmp_path / "nope.jsonl")], str(tmp_path / "o"))
    assert e.value.field == "--input"
    with pytest.raises(ConfigError) as e:
        preprocess([], str(tmp_path / "o"))
    assert e.value.field == "--input"
    with pytest.raises(ConfigError) as e:
        preprocess([str(tmp_path)], str(tmp_path / "o"))
    assert e.value.field == "--input"
    assert preprocess_main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "--input" in capsys.readouterr().err


def test_preprocess_cli(tmp_path, capsys):
    txt = tmp_path / "t.txt"
    txt.write_text(TEXT_FILE)
    assert (
        preprocess_main(["--input", str(txt), "--output-prefix", str(tmp_path / "p"), "--log-interval", "1"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["documents"] == 3


def test_text_documents_are_blank_line_separated(tmp_path):
    p = tmp_path / "x.md"
    p.write_text("\n\nonly one\ndoc here")
    assert list(iter_documents(str(p))) == ["only one\ndoc here"]


# ---------------------------------------------------------------------------------------------
# indexed datasets, splits, blends


def _write_corpus(tmp_path, letter, n_docs, seed=0):
    """n_docs documents made of `letter` plus a document number, varied lengths."""
    rng = np.random.default_rng(seed)
    path = tmp_path / f"{letter}.jsonl"
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"text": f"{letter}{i:04d}" + letter * int(rng.integers(1, 40))}) + "\n"
            for i in range(n_docs)
        )
    prefix = str(tmp_path / f"{letter}_text_document")
    preprocess([str(path)], prefix, log=lambda m: None)
    return prefix


def test_split_parsing():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split(None) == [1.0, 0.0, 0.0]
    for bad in ("a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(ConfigError) as e:
            parse_split(bad)
        assert e.value.field == "dataset.split"
    r = split_ranges(1000, parse_split("969,30,1"))
    assert r == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(7, parse_split("1,1,1"))[-1][1] == 7
    assert split_ranges(10, parse_split("1,1,0"))[-1] is None


def test_data_path_parsing():
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == [(pytest.approx(0.7), "a"), (pytest.approx(0.3), "b")]
    assert parse_data_path(["a", "b"]) == [(0.5, "a"), (0.5, "b")]
    assert parse_data_path("2 a 6 b") == [(0.25, "a"), (0.75, "b")]
    assert parse_data_path(None) == [] and parse_data_path([]) == []
    with pytest.raises(ConfigError) as e:
        parse_data_path(["0.5", "a", "b"])
    assert e.value.field == "dataset.data_path"


def _sample_texts(ds, tok):
    return [tok.decode(ds[i]["tokens"]) for i in range(len(ds))]


def _doc_ids(texts, letter):
    return {int(t[j + 1 : j + 5]) for t in texts for j in range(len(t) - 4)
            if t[j] == letter and t[j + 1 : j + 5].isdigit()}


def test_splits_use_disjoint_documents(tmp_path):
    prefix = _write_corpus(tmp_path, "d", 200)
    tok = ByteTokenizer()
    d = SimpleNamespace(data_path=[prefix], split="80,10,10")
    sets = build_gpt_datasets(d, 8, 1, tok, [50, 20, 20])
    seen = {name: _doc_ids(_sample_texts(ds, tok), "d") for name, ds in sets.items()}
    assert seen["train"] and seen["valid"] and seen["test"]
    assert max(seen["train"]) < min(seen["valid"]) <= max(seen["valid"]) < min(seen["test"])


def test_blend_with_weights(tmp_path):
    a = _write_corpus(tmp_path, "a", 80, seed=1)
    b = _write_corpus(tmp_path, "b", 80, seed=2)
    tok = ByteTokenizer()

    def share_of_a(data_path, n=1000):
        ds = build_gpt_datasets(SimpleNamespace(data_path=data_path, split="1"), 8, 1, tok, [n, 0, 0])["train"]
        # a sample of corpus a holds a's, digits or eod, never 'b' (and vice versa)
        return sum(1 for i in range(n) if b"b" not in bytes(int(x) for x in ds[i]["tokens"] if x < 256)) / n

    assert share_of_a(["0.7", a, "0.3", b]) == pytest.approx(0.7, abs=0.002)
    assert share_of_a(f"1 {a} 3 {b}") == pytest.approx(0.25, abs=0.002)  # Megatron's space-separated form
    sizes = [os.path.getsize(p + ".bin") for p in (a, b)]
    assert share_of_a([a, b]) == pytest.approx(sizes[0] / sum(sizes), abs=0.03)  # unweighted: by size


def test_indexed_training_through_the_loader_with_epochs_and_validation(tmp_path):
    prefix = _write_corpus(tmp_path, "e", 40)
    cfg = make_cfg(data_path=[prefix], split="90,10,0", seq_length=16, mbs=4, gbs=8, eval_interval=5, iters=40)
    assert split_sizes(cfg) == [320, 9 * 2 * 8, 2 * 8]  # (40 // 5 + 1) evaluations; test: one, after training
    train, valid = build_data_iterators(cfg, 0, 1)
    batches = take(train, 2 * len(train.dataset) // 4 + 3)  # past the planned samples: the order repeats
    assert all(b["tokens"].shape == (4, 16) and b["tokens"].max() <= 256 for b in batches)
    assert batches[0]["attention_mask"] is None
    n = len(train.dataset) // 4
    assert torch.equal(batches[n]["tokens"], batches[0]["tokens"]) or len(train.dataset) % 4
    vb = next(valid)
    assert vb["tokens"].shape == (4, 16)
    train.close()
    valid.close()


def test_missing_prefix_and_empty_splits(tmp_path):
    with pytest.raises(ConfigError) as e:
        build_data_iterators(make_cfg(data_path=[str(tmp_path / "missing")]), 0, 1)
    assert e.value.field == "dataset.data_path"
    prefix = _write_corpus(tmp_path, "f", 30)
    cfg = make_cfg(data_path=[prefix], split="100,0,0", eval_interval=10)
    with pytest.raises(ConfigError) as e:
        build_data_iterators(cfg, 0, 1)
    assert e.value.field == "dataset.split"
    cfg.validation.eval_interval = None
    train, valid = build_data_iterators(cfg, 0, 1)
    assert valid is None
    train.close()
    # a split that rounds to zero documents would make megatron-core spin forever: a config error instead
    with pytest.raises(ConfigError, match="gives the valid split 0 of the 30 documents") as e:
        build_data_iterators(make_cfg(data_path=[prefix], split="99,1,0", eval_interval=10), 0, 1)
    assert e.value.field == "dataset.split"
    # validation without eval_interval and test are only read after training: an empty one is left out
    train, valid, test = build_train_valid_test_data_iterators(make_cfg(data_path=[prefix], split="98,1,1"), 0, 1)
    assert len(valid.dataset) > 0 and test is None  # 1 document for validation, 0 for test
    train.close()
    valid.close()


def test_s3_prefix_gives_the_samples_of_the_local_copy(tmp_path, s3_server, monkeypatch):
    """An s3:// prefix is read through megatron-core's S3 reader (index cached, .bin by ranged GETs)."""
    prefix = _write_corpus(tmp_path, "s", 120)
    bucket, key = s3_server.new_bucket(), "corpora/s_text_document"
    for suffix in (".bin", ".idx"):
        s3_server.client().upload_file(prefix + suffix, bucket, key + suffix)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(datasets, "S3_BIN_CHUNK_BYTES", 512)  # many ranged GETs, and reads across chunks
    monkeypatch.setattr(datasets, "S3_INDEX_CACHE", str(tmp_path / "idx-cache"))
    tok = ByteTokenizer()

    def samples(data_path):
        sets = build_gpt_datasets(SimpleNamespace(data_path=data_path, split="90,10,0"), 16, 3, tok, [300, 40, 0])
        return [[ds[i]["tokens"].tolist() for i in range(n)] for ds, n in ((sets["train"], 300), (sets["valid"], 40))]

    local, remote = samples([prefix]), samples([f"s3://{bucket}/{key}"])
    assert remote == local and len({tuple(t) for t in local[0]}) > 100
    assert os.path.getsize(prefix + ".bin") > 4 * 512  # the .bin really spans several chunks
    assert os.path.isfile(tmp_path / "idx-cache" / bucket / (key + ".idx"))  # only the index is local
    assert not list((tmp_path / "idx-cache").rglob("*.bin"))
    with pytest.raises(ConfigError) as e:
        build_gpt_datasets(SimpleNamespace(data_path=[f"s3://{bucket}/nope"], split="1"), 16, 3, tok, [10, 0, 0])
    assert e.value.field == "dataset.data_path" and f"s3://{bucket}/nope" in str(e.value)
