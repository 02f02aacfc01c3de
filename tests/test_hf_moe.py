"""Hugging Face interop for mixtures of experts: tiny random Qwen3-MoE (a dense layer between two MoE layers,
router probabilities not renormalised, q/k norms) and Mixtral (renormalised top-k, sliding window) made by
`transformers` go through `kubetron import-hf`, the trainer's model, `kubetron export-hf` and back to
`transformers`; the MoE fields (experts, top-k, expert size, dense layers, router mode, aux-loss
coefficient) are carried both ways; what has no counterpart is refused in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.hf_utils import (
    SFT_LINES,
    config_for,
    finetune_args,
    hf_logits,
    imported_tensors,
    kubetron_logits,
    make_tiny_mixtral,
    make_tiny_qwen3_moe,
    )
from tests.inprocess import ensure_world_of_one, run_command

pytestmark = pytest.mark.trainer

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent
# fp32, the bound. Measured 1.6e-6 (Qwen3-MoE) and 1.2e-6 (Mixtral): megatron takes the top-k logits
# and then their softmax where transformers renormalises the top-k of the softmax (the same numbers, rounded
# differently), and sums the experts' outputs in another order.
TOL = 1e-4

# name: (maker, the printed model section's MoE keys, the exported config.json's MoE fields)
CASES = {
    "qwen3_moe": (make_tiny_qwen3_moe,
                  {"num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "ffn_hidden_size": 96,
                   "moe_layer_freq": [1, 0, 1], "moe_router_pre_softmax": True, "qk_layernorm": True,
                   "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.02},
                  {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "intermediate_size": 96, "mlp_only_layers": [1],
                   "decoder_sparse_step": 1, "norm_topk_prob": False, "router_aux_loss_coef": 0.02}),
    "mixtral": (make_tiny_mixtral,
                {"num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "moe_layer_freq": 1,
                 "moe_router_pre_softmax": False, "sliding_window": 8, "qk_layernorm": False,
                 "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.03},
                {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2,
                 "intermediate_size": 48, "sliding_window": 8, "router_aux_loss_coef": 0.03}),
}


def _build_and_load(keys: dict, tensors: dict, *overrides: str):
    from kubetron.checkpoint import canonical
    from kubetron.training.model import build_model

    model = build_model(config_for(keys, *overrides), torch.device("cpu"))
    canonical.load_model_state(model, tensors)
    return model


@pytest.mark.parametrize("name", CASES)
def test_moe_import_gives_transformers_logits_and_export_round_trips_bit_exact(name, tmp_path, capsys):
    """import-hf prints the MoE section; the model it builds gives transformers' logits (from the import
    and from the HF directory itself), and only with the right router mode; export-hf writes every tensor
    back bit for bit, the MoE fields into config.json, and transformers loads it with the same logits."""
    from kubetron.cli import main
    from kubetron.hf.io import load_hf_into_model
    from kubetron.training.model import build_model
    from safetensors.torch import load_file

    make, moe_keys, moe_config = CASES[name]
    hf = make(tmp_path / "hf")
    want = hf_logits(hf)
    assert main(["import-hf", str(hf), str(tmp_path / "ckpt")]) == 0
    keys = yaml.safe_load(capsys.readouterr().out)["model"]
    assert {k: keys.get(k) for k in moe_keys} == moe_keys

    ensure_world_of_one()
    tensors = imported_tensors(tmp_path / "ckpt")
    diff = (kubetron_logits(_build_and_load(keys, tensors)[0]) - want).abs().max().item()
    print(f"{name}: import-hf -> kubetron vs transformers, max abs logit diff {diff:.3g}")
    assert diff <= TOL
    model = build_model(config_for(keys), torch.device("cpu"))
    load_hf_into_model(model, config_for(keys), str(hf))  # pretrained_checkpoint = the HF directory itself
    assert (kubetron_logits(model[0]) - want).abs().max().item() <= TOL
    # the router mode is no no-op: renormalising (or not) the chosen probabilities gives other logits
    flipped = f"model.moe_router_pre_softmax={str(not keys['moe_router_pre_softmax']).lower()}"
    assert (kubetron_logits(_build_and_load(keys, tensors, flipped)[0]) - want).abs().max().item() > 0.1

    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: config.get(k) for k in moe_config} == moe_config
    original, exported = load_file(hf / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert any(".experts.7." in k for k in original)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    diff = (hf_logits(tmp_path / "out") - want).abs().max().item()
    print(f"{name}: export-hf -> transformers, max abs logit diff {diff:.3g}")
    assert diff <= TOL


def test_qwen3_moe_import_finetune_export_through_the_cli(tmp_path, capsys):
    """The user's path: import-hf -> finetune from its printed section (packed SFT, the aux loss on) ->
    export-hf. The experts, the router and the dense layer trained; transformers computes what the trained
    checkpoint (the sharded format) computes."""
    from kubetron.cli import main
    from kubetron.hf.io import read_checkpoint
    from safetensors.torch import load_file

    hf = make_tiny_qwen3_moe(tmp_path / "hf")
    capsys.readouterr()
    assert main(["import-hf", str(hf), str(tmp_path / "ckpt")]) == 0
    keys = yaml.safe_load(capsys.readouterr().out)["model"]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in SFT_LINES))
    p = run_command(finetune_args(tmp_path, data, tmp_path / "ckpt", keys, 2), tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    tuned, start = load_file(tmp_path / "out" / "model.safetensors"), load_file(hf / "model.safetensors")
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.up_proj.weight",
                 "model.layers.2.mlp.experts.3.down_proj.weight"):
        assert not torch.equal(tuned[name], start[name]), name
    ensure_world_of_one()
    keys, tensors, _, _ = read_checkpoint(str(tmp_path / "run"))
    diff = (kubetron_logits(_build_and_load(keys, tensors)[0]) - hf_logits(tmp_path / "out")).abs().max().item()
    print(f"trained Qwen3-MoE checkpoint vs its export in transformers: max abs logit diff {diff:.3g}")
    assert diff <= TOL
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["router_aux_loss_coef"], config["mlp_only_layers"], config["norm_topk_prob"]) == (0.02, [1], False)


def test_lora_on_experts_exports_merged_and_refuses_adapter_only(tmp_path, capsys):
    """LoRA on a Mixtral import (adapters on attention and on every expert's fc1/fc2): the merged export
    computes what kubetron's base + adapters compute; --adapter-only is one line, exit 2, nothing written
    (PEFT has no by-name form for transformers' fused expert parameters)."""
    from kubetron.checkpoint import canonical
    from kubetron.checkpoint.adapters import is_adapter_name, is_base_name
    from kubetron.cli import main
    from kubetron.hf.io import import_hf, read_checkpoint
    from kubetron.training.model import build_model

    hf = make_tiny_mixtral(tmp_path / "hf")
    keys = import_hf(str(hf), str(tmp_path / "ckpt"))
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in SFT_LINES))
    lora = ["peft.scheme=lora", "peft.dim=4", "peft.alpha=8.0", "optimizer.lr=2e-2"]
    p = run_command([*finetune_args(tmp_path, data, tmp_path / "ckpt", keys, 2), *lora], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    adapters = read_checkpoint(str(tmp_path / "run"))[1]
    assert any(".experts.local_experts.7.linear_fc2.adapter." in k for k in adapters)
    capsys.readouterr()
    assert main(["export-hf", "--adapter-only", str(tmp_path / "run"), str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--adapter-only" in err and "experts" in err, err
    assert not (tmp_path / "adapter").exists()
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0

    ensure_world_of_one()
    cfg = config_for(keys, *lora[:3], f"checkpoint.pretrained_checkpoint={tmp_path / 'ckpt'}")
    model = build_model(cfg, torch.device("cpu"))
    base = imported_tensors(tmp_path / "ckpt")
    canonical.load_model_state(model, base, keep=is_base_name)
    canonical.load_model_state(model, adapters, keep=is_adapter_name)
    merged = hf_logits(tmp_path / "merged")
    diff = (kubetron_logits(model[0]) - merged).abs().max().item()
    print(f"Mixtral, LoRA on experts: kubetron base + adapters vs transformers on the merged export {diff:.3g}")
    assert diff <= TOL
    assert (merged - hf_logits(hf)).abs().max().item() > 1e-2  # the adapters changed the model


@pytest.mark.process
def test_mixtral_import_at_ep2_gives_transformers_logits(tmp_path):
    """Expert parallelism: two ranks (torchrun, gloo) hold 4 of the 8 experts each, from import-hf's
    checkpoint and from the HF directory itself, and give transformers' logits."""
    from kubetron.hf.io import import_hf

    from tests.multirank.runner import environment, free_port

    hf = make_tiny_mixtral(tmp_path / "hf")
    import_hf(str(hf), str(tmp_path / "ckpt"))
    out = tmp_path / "logits.pt"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    p = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
                        "tests.multirank.hf_logits", str(tmp_path / "ckpt"), str(hf), str(out), "ep"],
                       cwd=REPO, env=environment(tmp_path), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = torch.load(out, weights_only=True), hf_logits(hf)
    assert got["local_experts"] == 4
    for key in ("from_checkpoint", "from_hf_dir"):
        diff = (got[key] - want).abs().max().item()
        print(f"Mixtral EP=2 {key} vs transformers: max abs logit diff {diff:.3g}")
        assert diff <= TOL


def test_qwen3_moe_renormalised_router_and_a_run_that_differs_from_the_hf_directory(tmp_path):
    """norm_topk_prob true is megatron's top-k then softmax (moe_router_pre_softmax false), with the same
    logits; a run whose MoE keys differ from the HF directory's or the import's may not load it (the field
    is named)."""
    from kubetron.checkpoint.layout import check_architecture
    from kubetron.contract.errors import ConfigError
    from kubetron.hf.io import import_hf, load_hf_into_model
    from kubetron.training.model import build_model

    hf = make_tiny_qwen3_moe(tmp_path / "hf", norm_topk_prob=True, mlp_only_layers=())
    keys = import_hf(str(hf), str(tmp_path / "ckpt"))
    assert (keys["moe_router_pre_softmax"], keys["moe_layer_freq"]) == (False, 1)
    ensure_world_of_one()
    tensors = imported_tensors(tmp_path / "ckpt")
    assert (kubetron_logits(_build_and_load(keys, tensors)[0]) - hf_logits(hf)).abs().max().item() <= TOL
    cfg = config_for(keys, "model.moe_router_topk=3")
    with pytest.raises(ConfigError, match="model.moe_router_topk: HF 2, this run 3"):
        load_hf_into_model(build_model(cfg, torch.device("cpu")), cfg, str(hf))
    # ... nor the import (its architecture record); the same layers written out one by one are the same model
    common = torch.load(tmp_path / "ckpt" / "iter_0000000" / "common.pt", weights_only=True)
    with pytest.raises(ConfigError, match="model.moe_router_pre_softmax: checkpoint False, this run True"):
        check_architecture(common["model_config"], config_for(keys, "model.moe_router_pre_softmax=true"), "x")
    check_architecture(common["model_config"], config_for(keys, "model.moe_layer_freq=[1,1,1]"), "x")


def _edit_config(hf: Path, **fields) -> Path:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(fields)
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


@pytest.mark.parametrize("maker,fields,named", [
    (make_tiny_mixtral, {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    (make_tiny_mixtral, {"num_experts_per_tok": 1}, "num_experts_per_tok"),
    (make_tiny_qwen3_moe, {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    (make_tiny_qwen3_moe, {"mlp_only_layers": [0, 1, 2]}, "mlp_only_layers"),
    (make_tiny_qwen3_moe, {"decoder_sparse_step": 0}, "decoder_sparse_step"),
], ids=["jitter", "top1-renormalised", "qwen3moe-window", "no-moe-layer", "sparse-step-0"])
def test_unrepresentable_moe_configs_are_refused_naming_the_field(tmp_path, maker, fields, named):
    from kubetron.contract.errors import ConfigError
    from kubetron.hf.config_map import model_section, read_hf_config

    hf = _edit_config(maker(tmp_path / "hf"), **fields)
    with pytest.raises(ConfigError, match=f"config.json: {named}"):
        model_section(read_hf_config(str(hf)))


def test_unrepresentable_moe_config_is_one_line_exit_2_nothing_written(tmp_path, capsys):
    from kubetron.cli import main

    hf = _edit_config(make_tiny_mixtral(tmp_path / "hf"), router_jitter_noise=0.1)
    capsys.readouterr()  # transformers' progress bars
    assert main(["import-hf", str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "config.json: router_jitter_noise" in err, err
    assert not (tmp_path / "out").exists()


MIXTRAL = {"normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False, "vocab_size": 512,
           "num_layers": 2, "num_moe_experts": 4, "moe_router_topk": 2}


@pytest.mark.parametrize("fields,named", [
    ({"moe_shared_expert_intermediate_size": 32}, "model.moe_shared_expert_intermediate_size"),
    ({"moe_layer_freq": [1, 0]}, "model.moe_layer_freq"),
    ({"moe_layer_freq": 2}, "model.moe_layer_freq"),
    ({"moe_router_pre_softmax": True}, "model.moe_router_pre_softmax"),
    ({"add_qkv_bias": True}, "model.add_qkv_bias"),
], ids=["shared-experts", "dense-layers-list", "dense-layers-freq", "pre-softmax", "qkv-bias"])
def test_export_refuses_moe_models_no_hf_architecture_has(fields, named):
    """Mixtral (no q/k norms) has an MoE block on every layer and renormalises the top-k; neither it nor
    Qwen3-MoE has shared experts or q/k/v biases. With q/k norms, dense layers and pre-softmax map."""
    from kubetron.contract.config import GPTModelConfig
    from kubetron.contract.errors import ConfigError
    from kubetron.hf.config_map import hf_config

    m = GPTModelConfig(**MIXTRAL, **fields).model_dump()
    with pytest.raises(ConfigError, match=f"{named}: export-hf"):
        hf_config(m)
    if named in ("model.moe_layer_freq", "model.moe_router_pre_softmax"):
        qwen = hf_config({**m, "qk_layernorm": True})
        assert qwen["architectures"] == ["Qwen3MoeForCausalLM"]
        assert (qwen["mlp_only_layers"], qwen["norm_topk_prob"]) == (
            [1] if "moe_layer_freq" in fields else [], "moe_router_pre_softmax" not in fields)
