"""Real tokenizers, `kubetron preprocess`, megatron-core's datasets, tokenizer files in
checkpoints. Through what users run (the CLI, the trainer) where it matters."""

from __future__ import annotations

import importlib.resources
import json
import logging
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from kubetron.config import TokenizerConfig
from kubetron.contract import exitcodes
from kubetron.contract.config import GPTDatasetConfig
from kubetron.contract.errors import ConfigError
from kubetron.data import preprocess as preprocess_mod
from kubetron.data.datasets import build_gpt_datasets
from kubetron.data.loader import build_data_iterators
from kubetron.data.preprocess import preprocess
from kubetron.data.tokenizer import build_tokenizer, tokenizer_assets, tokenizer_from_assets

from tests.inprocess import Driver, drive_argv
from tests.trainer_utils import TINY, kubetron_cmd, run, tb_scalars

pytestmark = pytest.mark.unit

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Ünïcödé — 42 × 7 = 294.",
    "line one\nline two, with a tab\there",
    "emoji 🚀 and 中文 in one document",
    "Tokenizers are trained inside the test; nothing is downloaded.",
    "Short.",
]


def _train_bpe(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory):
    """A tokenizer.json directory (with its tokenizer_config.json), GPT-2 vocab/merges, and mistral-common's .model."""
    d = tmp_path_factory.mktemp("tokenizers")
    tok = _train_bpe(TEXTS * 3, 320)
    (d / "hf").mkdir()
    tok.save(str(d / "hf" / "tokenizer.json"))
    (d / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<pad>"}))
    (d / "gpt2").mkdir()
    tok.model.save(str(d / "gpt2"))
    sp_model = importlib.resources.files("mistral_common") / "data" / "tokenizer.model.v1"
    return {
        "HuggingFaceTokenizer": {"tokenizer_model": str(d / "hf")},
        "GPT2BPETokenizer": {"vocab_file": str(d / "gpt2" / "vocab.json"),
                             "merge_file": str(d / "gpt2" / "merges.txt")},
        "SentencePieceTokenizer": {"tokenizer_model": str(sp_model)},
        "dir": d,
    }


def _jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return str(path)


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer"])
def test_text_round_trips_through_preprocess_dataset_and_decode(tok_files, tmp_path, kind):
    tok = build_tokenizer(TokenizerConfig(tokenizer_type=kind, **tok_files[kind]))
    assert tok.eod is not None and tok.vocab_size == (32000 if kind == "SentencePieceTokenizer" else 320)
    out = preprocess([_jsonl(tmp_path / "c.jsonl", TEXTS)], str(tmp_path / "c"), tokenizer=tok, workers=2,
                     log=lambda m: None)
    assert out["documents"] == len(TEXTS)
    # one sample of megatron-core's GPTDataset holds the whole (shuffled) corpus: cut it at eod, decode
    ds = build_gpt_datasets(SimpleNamespace(data_path=[str(tmp_path / "c")], split="1"), out["tokens"] - 1, 7, tok,
                            [1, 0, 0])["train"]
    sample = ds[0]
    stream = np.append(sample["tokens"], sample["labels"][-1])
    cuts = np.flatnonzero(stream == tok.eod)
    docs = [tok.decode(piece) for piece in np.split(stream, cuts + 1)[:-1]]
    assert sorted(docs) == sorted(TEXTS)
    # the assets rebuild the same tokenizer (what a checkpoint carries)
    again = tokenizer_from_assets(kind, tokenizer_assets(TokenizerConfig(tokenizer_type=kind, **tok_files[kind])))
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1]) and again.eod == tok.eod


def test_workers_give_the_same_output_and_progress_lines(tok_files, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preprocess_mod, "CHUNK_BYTES", 300)  # many work units from a small corpus
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", **tok_files["HuggingFaceTokenizer"]))
    src = _jsonl(tmp_path / "big.jsonl", [f"{i}: {TEXTS[i % len(TEXTS)]}" for i in range(300)])
    lines = []
    one = preprocess([src], str(tmp_path / "w1"), tokenizer=tok, workers=1, log=lines.append, log_interval=0,
                     tty=False)
    three = preprocess([src], str(tmp_path / "w3"), tokenizer=tok, workers=3, log=lambda m: None, log_interval=0,
                       tty=True)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w3{ext}").read_bytes()
    assert one["tokens"] == three["tokens"] and one["documents"] == 300
    progress = [ln for ln in lines if "ETA" in ln]  # pod logs: plain lines with documents, tokens, ETA
    assert progress and "documents" in progress[-1] and "tokens/s" in progress[-1]
    assert "\r" not in "".join(lines)
    assert "\rpreprocess: " in capsys.readouterr().err  # a terminal: one refreshed line


def _megatron_tokenizer(tok):
    return SimpleNamespace(eod=tok.eod, pad=tok.pad, vocab_size=tok.vocab_size,
                           unique_identifiers={"class": "test"})


def _mcore_samples(blend, blend_per_split, split, seq_length, seed, tok, sizes):
    """Samples straight from megatron-core's own builder and config (no kubetron code)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as McoreConfig

    config = McoreConfig(random_seed=seed, sequence_length=seq_length, blend=blend, blend_per_split=blend_per_split,
                         split=split, tokenizer=_megatron_tokenizer(tok), reset_position_ids=True,
                         reset_attention_mask=True, eod_mask_loss=True,
                         path_to_cache="")  # in memory: a cache directory needs torch.distributed
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def _kubetron_global_samples(cfg, dp, n):
    """The first n global samples, as the dp ranks' iterators hand them out (micro-batch by micro-batch)."""
    its = [build_data_iterators(cfg, r, dp)[0] for r in range(dp)]
    out = []
    while len(out) < n:
        for it in its:
            b = next(it)
            out += [{k: v[i].numpy() for k, v in b.items() if v is not None} for i in range(b["tokens"].shape[0])]
    for it in its:
        it.close()
    return out[:n]


def _corpus(tmp_path, tok, letter, n):
    texts = [f"{letter}{i} " + TEXTS[i % len(TEXTS)] * (1 + i % 3) for i in range(n)]
    return preprocess([_jsonl(tmp_path / f"{letter}.jsonl", texts)], str(tmp_path / letter), tokenizer=tok,
                      log=lambda m: None)["outputs"][0]


def test_blended_sample_order_equals_megatron_core(tok_files, tmp_path):
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", **tok_files["HuggingFaceTokenizer"]))
    a, b = _corpus(tmp_path, tok, "a", 60), _corpus(tmp_path, tok, "b", 90)
    iters, gbs, eval_interval, eval_iters, T = 20, 8, 5, 2, 24
    sizes = [iters * gbs, (iters // eval_interval + 1) * eval_iters * gbs, eval_iters * gbs]  # Megatron's counts
    for dataset, blend, per_split in (
        (dict(data_path=f"0.3 {a} 0.7 {b}", split="90,8,2"), ([a, b], [0.3, 0.7]), None),
        (dict(train_data_path=[a, b], valid_data_path=[b]), None, [([a, b], None), ([b], None), None]),
    ):
        section = GPTDatasetConfig(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
                                   prefetch=1, pin_memory=False, **dataset)
        cfg = SimpleNamespace(
            model=SimpleNamespace(seq_length=T, vocab_size=384), dataset=section, rng=SimpleNamespace(seed=1234),
            train=SimpleNamespace(micro_batch_size=2, global_batch_size=gbs, num_microbatches=2, train_iters=iters),
            tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", **tok_files["HuggingFaceTokenizer"]),
            validation=SimpleNamespace(eval_interval=eval_interval, eval_iters=eval_iters))
        mine = _kubetron_global_samples(cfg, 2, sizes[0])
        theirs = _mcore_samples(blend, per_split, dataset.get("split"), T, 1234, tok, sizes)[0]
        for i in range(sizes[0]):
            ref = theirs[i]
            for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
                np.testing.assert_array_equal(mine[i][key], ref[key].numpy(), err_msg=f"sample {i} {key}")
        assert any((s["position_ids"][1:] == 0).any() for s in mine)  # documents do reset positions
        assert any(s["attention_mask"].sum() > T * (T - 1) / 2 for s in mine)  # and attention


def _kubetron(args, tmp_path):
    return subprocess.run(kubetron_cmd(*args), capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.mark.process
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tok_files, tmp_path):
    good = _jsonl(tmp_path / "good.jsonl", TEXTS)
    out = tmp_path / "out"
    p = _kubetron(["preprocess", "--input", good, "--output-prefix", str(out / "p"), "--tokenizer-type",
                   "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "missing.json")], tmp_path)
    assert p.returncode == exitcodes.CONFIG_ERROR
    assert p.stderr.strip().splitlines() == [f"kubetron: error: --tokenizer-model: {tmp_path}/missing.json: "
                                             "no such file"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "fine"}) + "\n" +
                   json.dumps({"body": "no text key"}) + "\n")
    p = _kubetron(["preprocess", "--input", str(bad), "--output-prefix", str(out / "p"), "--workers", "2"], tmp_path)
    assert p.returncode == exitcodes.CONFIG_ERROR
    assert p.stderr.strip().splitlines() == [f"kubetron: error: --json-keys: {bad}:3: no 'text' key "
                                             "(keys: ['body'])"]
    assert not out.exists() or not list(out.iterdir())  # nothing written, not even temporary files
    p = _kubetron(["config", "--config", TINY, "tokenizer.tokenizer_type=SentencePieceTokenizer",
                   f"tokenizer.tokenizer_model={tmp_path}/nope.model"], tmp_path)
    assert p.returncode == exitcodes.CONFIG_ERROR
    assert p.stderr.strip().splitlines()[-1].endswith(f"tokenizer.tokenizer_model: {tmp_path}/nope.model: no such file")


# -- training: the checkpoint holds the tokenizer, a resume uses it, megatron-core data resumes bit-exact ----------

ITERS = 12  # signalled at 5 (tests/inprocess.py: exactly there)


@pytest.fixture(scope="module")
def trained(tok_files, tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    shutil.copytree(tok_files["dir"] / "hf", d / "tok")
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(d / "tok")))
    prefix = _corpus(d, tok, "t", 120)
    common = ["train", "--config", TINY, f"train.train_iters={ITERS}", "checkpoint.save_interval=4",
              "logger.log_interval=1", "model.seq_length=32", "dataset.split=90,10,0", f"dataset.data_path={prefix}",
              "dataset.reset_position_ids=true", "dataset.reset_attention_mask=true", "dataset.eod_mask_loss=true",
              "tokenizer.tokenizer_type=HuggingFaceTokenizer", f"tokenizer.tokenizer_model={d / 'tok'}"]
    ref = d / "ref"
    p = run([*common, f"checkpoint.save={ref}", f"logger.tensorboard_dir={ref}/tb"], d)
    assert p.returncode == 0, p.stderr[-3000:]
    return {"dir": d, "common": common, "loss": tb_scalars(ref / "tb")}


@pytest.mark.process
def test_checkpoint_holds_the_tokenizer_and_a_resume_uses_it(trained, caplog):
    d, common = trained["dir"], trained["common"]
    original = (d / "tok" / "tokenizer.json").read_bytes()
    run_dir = d / "run"
    args = [*common, f"checkpoint.save={run_dir}", f"checkpoint.load={run_dir}", f"logger.tensorboard_dir={run_dir}/tb"]
    out = drive_argv(d, args, driver=Driver().signal_at(5))
    assert out.code == exitcodes.SAVED_ON_SIGNAL and out.termination["lastCheckpoint"] == 5
    saved = 5
    assert (run_dir / f"iter_{saved:07d}" / "tokenizer" / "tokenizer.json").read_bytes() == original
    assert (run_dir / f"iter_{saved:07d}" / "tokenizer" / "tokenizer_config.json").is_file()
    # the tokenizer at the configured path changes (another vocabulary: another padded embedding size);
    # the resume still trains with the checkpoint's own tokenizer, bit-exact with the uninterrupted run
    other = _train_bpe(TEXTS, 600)
    assert other.get_vocab_size() > 384  # on its own it would make a 512-row embedding
    other.save(str(d / "tok" / "tokenizer.json"))
    caplog.set_level(logging.INFO, logger="kubetron")
    assert drive_argv(d, args).code == 0
    assert "resuming with the checkpoint's" in caplog.text
    run_config = yaml.safe_load((run_dir / f"iter_{ITERS:07d}" / "run_config.yaml").read_text())
    assert run_config["model"]["vocab_size"] == 384  # 320 tokens padded to a multiple of 128
    assert (run_dir / f"iter_{ITERS:07d}" / "tokenizer" / "tokenizer.json").read_bytes() == original
    loss = tb_scalars(run_dir / "tb")
    assert {i: loss[i] for i in range(saved + 1, ITERS + 1)} == \
        {i: trained["loss"][i] for i in range(saved + 1, ITERS + 1)}


def test_tokenizer_files_on_s3(tok_files, s3_server, monkeypatch):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        client.put_object(Bucket=bucket, Key=f"tok/{name}", Body=(tok_files["dir"] / "hf" / name).read_bytes())
    local = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", **tok_files["HuggingFaceTokenizer"]))
    for path in (f"s3://{bucket}/tok", f"s3://{bucket}/tok/tokenizer.json"):
        remote = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path))
        assert remote.encode(TEXTS[3]) == local.encode(TEXTS[3]) and remote.eod == local.eod
    with pytest.raises(ConfigError) as e:
        build_tokenizer(TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=f"s3://{bucket}/x.model"))
    assert e.value.field == "tokenizer.tokenizer_model" and "no such file" in e.value.message
