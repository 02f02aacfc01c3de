"""LoRA fine-tuning, through the real `kubetron finetune`: adapters on a tiny Llama
read from a Hugging Face directory (SwiGLU fc1, grouped-query attention, untied output), base frozen,
adapter-only checkpoints, SIGTERM + exact resume, TP=2 against TP=1, merge-on-export."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kubetron.contract import exitcodes
from kubetron.events import Started

from tests.hf_utils import TOKENS, config_for, hf_logits, kubetron_logits, make_tiny_llama
from tests.inprocess import Driver, drive_argv, ensure_world_of_one
from tests.multirank.runner import launch
from tests.trainer_utils import TINY, run, tb_scalars

pytestmark = pytest.mark.process

pytest.importorskip("transformers")
ITERS = 20
DIM, ALPHA = 4, 8.0
LORA = ["peft.scheme=lora", f"peft.dim={DIM}", f"peft.alpha={ALPHA}"]
TP_TOL = 1e-5  # |loss(TP or PP=2) - loss(1 rank)| over 20 iterations, fp32 on CPU (measured: TP 4.8e-07, PP 0, DP 0)
SUMMARY = re.compile(r"trainable parameters (\d+) of (\d+) .*optimizer state (\d+) bytes "
                     r"\(full fine-tune: (\d+) bytes\)")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from kubetron.hf.io import _model_keys

    root = tmp_path_factory.mktemp("lora")
    hf = make_tiny_llama(root / "llama")
    return SimpleNamespace(root=root, hf=hf, keys=_model_keys(str(hf)))


def finetune_args(base, store: Path, *extra: str) -> list[str]:
    model = [f"model.{k}={json.dumps(v)}" for k, v in base.keys.items() if k != "seq_length"]
    return ["finetune", *model, "model.seq_length=64", "tokenizer.tokenizer_type='null'", "tokenizer.vocab_size=512",
            f"train.train_iters={ITERS}", "train.micro_batch_size=4", "train.global_batch_size=8",
            "optimizer.lr=2e-2", "scheduler.lr_decay_style=constant", "validation.eval_interval=null",
            f"checkpoint.pretrained_checkpoint={base.hf}", f"checkpoint.save={store}", f"checkpoint.load={store}",
            "checkpoint.save_interval=10", "logger.log_interval=1", f"logger.tensorboard_dir={store}/tb", *extra]


@pytest.fixture(scope="module")
def reference(base):
    """20 LoRA iterations, checkpoints at 10 and 20 (one process)."""
    store = base.root / "ref"
    p = run(finetune_args(base, store, *LORA), base.root)
    assert p.returncode == 0, p.stderr[-3000:]
    return SimpleNamespace(store=store, loss=tb_scalars(store / "tb"), out=p.stdout + p.stderr)


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _expected_trainable(keys: dict) -> int:
    """dim x (in + out) per adapted linear: qkv, proj, fc1 (gate and up), fc2; per layer."""
    h, ffn, heads, groups = keys["hidden_size"], keys["ffn_hidden_size"], keys["num_attention_heads"], \
        keys["num_query_groups"]
    qkv_out = h + 2 * groups * (h // heads)
    per_layer = DIM * ((h + qkv_out) + (h + h) + (h + 2 * ffn) + (ffn + h))
    return keys["num_layers"] * per_layer


def test_lora_trains_only_adapters_and_saves_them_alone(base, reference):
    from kubetron.checkpoint.format_sharded import read_canonical
    from kubetron.storage import open_store

    loss = reference.loss
    assert sorted(loss) == list(range(1, ITERS + 1))
    print(f"LoRA lm loss: iteration 1 {loss[1]:.3f} -> iteration {ITERS} {loss[ITERS]:.3f}")
    assert loss[ITERS] < loss[1] - 0.2, f"loss did not fall: {loss[1]} -> {loss[ITERS]}"
    trainable, total, state, full_state = map(int, SUMMARY.search(reference.out).groups())
    assert trainable == _expected_trainable(base.keys) and total > 20 * trainable
    assert state == 8 * trainable and full_state == 8 * total  # Adam: two fp32 moments per trained element
    # the checkpoint: adapter tensors and their Adam moments only, exactly the bytes the log announced
    model, optim = read_canonical(open_store(str(reference.store)), "iter_0000020")
    assert model and all(".adapter.linear_" in k for k in model), sorted(model)[:5]
    assert sum(t.numel() for t in model.values()) == trainable
    assert set(optim) == set(model)
    moments = sum(s[k].numel() * s[k].element_size() for s in optim.values() for k in ("exp_avg", "exp_avg_sq"))
    assert moments == state
    # ... against a full fine-tune's checkpoint of the same model (weights + Adam state)
    full = base.root / "full"
    p = run(finetune_args(base, full, "train.train_iters=1"), base.root)
    assert p.returncode == 0, p.stderr[-3000:]
    ratio = _dir_bytes(reference.store / "iter_0000020") / _dir_bytes(full / "iter_0000001")
    print(f"LoRA checkpoint / full fine-tune checkpoint: {ratio:.3f} (trainable {trainable} of {total})")
    assert ratio < 0.2, ratio


def test_sigterm_then_resume_is_bit_exact(base, reference, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kubetron")
    store = tmp_path / "run"
    out = drive_argv(tmp_path, finetune_args(base, store, *LORA), driver=Driver().signal_at(3))
    assert out.code == exitcodes.SAVED_ON_SIGNAL and out.termination["lastCheckpoint"] == 3
    saved = 3
    assert (store / f"iter_{saved:07d}" / "metadata.json").is_file()
    caplog.clear()
    resumed = drive_argv(tmp_path, finetune_args(base, store, *LORA))
    assert resumed.code == 0 and resumed.driver.of(Started)[0].iteration == saved
    assert "finetuning from the Hugging Face model" in caplog.text  # the base, then the adapters
    loss = tb_scalars(store / "tb")
    assert {i: loss[i] for i in range(saved + 1, ITERS + 1)} == \
        {i: reference.loss[i] for i in range(saved + 1, ITERS + 1)}


LAYOUTS = {"tensor": ["model.tensor_model_parallel_size=2"], "pipeline": ["model.pipeline_model_parallel_size=2"],
           "data": ["ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_equal_one_rank(base, reference, tmp_path, layout):
    """TP=2: B of column-parallel qkv/fc1 and A of row-parallel proj/fc2 are split over the two ranks;
    PP=2: each stage holds its layers' adapters (global layer numbers in the checkpoint); DP=2 with the
    distributed optimizer and overlapped grad buffers: frozen weights have no buffer space, no state."""
    from kubetron.checkpoint.format_sharded import read_canonical
    from kubetron.storage import open_store

    store = tmp_path / layout
    r = launch(finetune_args(base, store, *LORA, *LAYOUTS[layout]), tmp_path / "ranks")
    assert r.codes == {0: 0, 1: 0}, r.tail()
    index = json.loads((store / "iter_0000020" / "shards" / "rank_00001.json").read_text())
    assert any(e["name"].startswith("optim/") for e in index["pieces"])  # each rank saves its part
    assert all(".adapter.linear_" in e["name"] for e in index["pieces"])
    loss = tb_scalars(store / "tb")
    worst = max(abs(loss[i] - reference.loss[i]) for i in range(1, ITERS + 1))
    print(f"max |loss({layout} parallel 2) - loss(one rank)| over {ITERS} iterations: {worst:.3g}")
    assert worst <= TP_TOL, {i: (loss[i], reference.loss[i]) for i in range(1, ITERS + 1)}
    # the TP=2 adapters, gathered from their shards, are the TP=1 ones
    tp1 = read_canonical(open_store(str(reference.store)), "iter_0000020")[0]
    tp2 = read_canonical(open_store(str(store)), "iter_0000020")[0]
    assert set(tp1) == set(tp2)
    diff = max((tp1[k] - tp2[k]).abs().max().item() for k in tp1)
    print(f"max |adapter({layout} parallel 2) - adapter(one rank)| after {ITERS} iterations: {diff:.3g}")
    assert diff <= 1e-4  # measured: 2.2e-06


def test_merged_export_equals_base_plus_adapter_forward(base, reference, tmp_path):
    from kubetron.checkpoint import canonical
    from kubetron.checkpoint.adapters import is_adapter_name, is_base_name
    from kubetron.hf.io import export_hf, load_hf_canonical, read_checkpoint
    from kubetron.training.model import build_model
    from safetensors.torch import load_file

    export_hf(str(reference.store), str(tmp_path / "merged"))
    # kubetron's model with adapters: base from the HF directory, adapters from the LoRA checkpoint
    ensure_world_of_one()
    cfg = config_for(base.keys, *LORA, f"checkpoint.pretrained_checkpoint={base.hf}")
    model = build_model(cfg, torch.device("cpu"))
    canonical.load_model_state(model, load_hf_canonical(str(base.hf))[1], keep=is_base_name)
    canonical.load_model_state(model, read_checkpoint(str(reference.store))[1], keep=is_adapter_name)
    adapted = kubetron_logits(model[0])
    merged = hf_logits(tmp_path / "merged")
    diff = (adapted - merged).abs().max().item()
    print(f"max |logits(kubetron base + adapters) - logits(transformers, merged export)|: {diff:.3g}")
    assert diff <= 1e-4
    assert (merged - hf_logits(base.hf)).abs().max().item() > 1e-2  # the adapters changed the model
    # pretrained_checkpoint was the HF directory itself: its special ids reach the export
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["eos_token_id"] == 256

    # --adapter-only: PEFT's files; applying them to the base by PEFT's rule gives the merged weights
    export_hf(str(reference.store), str(tmp_path / "peft"), adapter_only=True)
    conf = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == DIM and conf["lora_alpha"] == ALPHA
    assert sorted(conf["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"])
    lora = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert len(lora) == 2 * 7 * base.keys["num_layers"]
    start, want = load_file(base.hf / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    for key in (k for k in lora if k.endswith("lora_A.weight")):
        hf_name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        b = lora[key.replace("lora_A", "lora_B")]
        got = start[hf_name] + conf["lora_alpha"] / conf["r"] * (b @ lora[key])
        assert torch.allclose(got, want[hf_name], atol=1e-6), hf_name
    adapted = {k.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight") for k in lora}
    frozen = [k for k in start if k not in adapted]  # embeddings, norms, output layer: bit-identical
    assert frozen and all(torch.equal(start[k], want[k]) for k in frozen)
    # ... and PEFT itself loads it onto the HF directory it names, computing the merged model's logits
    peft = pytest.importorskip("peft")
    assert conf["base_model_name_or_path"] == str(base.hf.resolve())
    with torch.no_grad():
        by_peft = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "peft").eval()(TOKENS).logits
    assert (by_peft - merged).abs().max().item() <= 1e-4


def test_config_errors_are_one_line_exit_2(tmp_path):
    from kubetron.config import ConfigContainer
    from kubetron.contract.errors import ConfigError

    def error(**peft) -> str:
        data = {"train": {"train_iters": 1}, "peft": peft, "checkpoint": {"pretrained_checkpoint": "/base"}}
        with pytest.raises(ConfigError) as e:
            ConfigContainer.from_dict(data)
        return str(e.value)

    assert "peft.target_modules" in error(scheme="lora", target_modules=["linear_qkv", "q_proj"])
    assert "'q_proj'" in error(scheme="lora", target_modules=["q_proj"])
    assert "peft.dim" in error(scheme="lora", dim=0)
    assert "peft.dim" in error(dim=8)  # without a scheme it would be ignored
    p = run(["finetune", "--config", TINY, "peft.scheme=lora"], tmp_path)
    assert p.returncode == exitcodes.CONFIG_ERROR
    assert p.stderr.strip().count("\n") == 0 and "checkpoint.pretrained_checkpoint" in p.stderr, p.stderr


def test_adapter_checkpoint_without_its_peft_section_is_exit_2(base, reference, tmp_path):
    """Resuming LoRA adapters without the peft section (or with another dim) is a spec error: one line, 2."""
    args = finetune_args(base, tmp_path / "run", f"checkpoint.load={reference.store}")
    p = run(args, tmp_path)
    assert p.returncode == exitcodes.CONFIG_ERROR, p.stderr[-3000:]
    assert p.stderr.strip().count("\n") == 0 and "peft.scheme" in p.stderr and "adapters only" in p.stderr
    from kubetron.checkpoint import adapters
    from kubetron.contract.errors import ConfigError

    cfg = config_for(base.keys, *LORA, f"checkpoint.pretrained_checkpoint={base.hf}", "peft.dim=8")
    saved = {"dim": DIM, "target_modules": list(cfg.peft.target_modules), "pretrained_checkpoint": str(base.hf)}
    with pytest.raises(ConfigError, match="peft.dim"):
        adapters.load_filter(saved, cfg, "iter_0000020", as_pretrained=False)
    with pytest.raises(ConfigError, match="checkpoint.pretrained_checkpoint"):
        adapters.load_filter(saved, cfg, "iter_0000020", as_pretrained=True)


@pytest.mark.parametrize("position", ["pre", "post"])
def test_adapter_dropout(position):
    """dropout acts in training only; `post` drops output elements, `pre` input elements."""
    from kubetron.training.peft import LoRAAdapter

    ensure_world_of_one()
    adapter = LoRAAdapter(torch.nn.Linear(8, 6, bias=False), row=False, dim=4, alpha=4.0, dropout=0.5,
                          dropout_position=position, seed=1)
    torch.nn.init.normal_(adapter.linear_out.weight)
    x = torch.randn(3, 2, 8)
    want = adapter.eval()(x)
    got = adapter.train()(x)
    assert not torch.allclose(got, want)
    dropped = got == 0
    if position == "post":
        assert dropped.any()
        torch.testing.assert_close(got[~dropped], want[~dropped] * 2)
    else:
        assert not dropped.any()

