"""Mixture of experts (megatron-core's MoE layers): the config's one-line errors (training and
checkpoints: tests/test_moe_expert_parallel.py)."""

from __future__ import annotations

import pytest
from kubetron.cli import main

MOE = "train: {train_iters: 5}\nmodel: {num_layers: 2, num_moe_experts: 4, add_bias_linear: false}\n"

# (id, yaml, world size, field the one-line error names)
ERRORS = [
    ("topk-above-experts", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, moe_router_topk: 5"), 1,
     "model.moe_router_topk"),
    ("topk-1-needs-pre-softmax", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, moe_router_topk: 1"), 1,
     "model.moe_router_pre_softmax"),
    ("ep-not-dividing-experts", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, expert_model_parallel_size: 3"),
     3, "model.expert_model_parallel_size"),
    ("ep-not-dividing-dp", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, expert_model_parallel_size: 2"),
     3, "model.expert_model_parallel_size"),
    ("moe-key-without-experts", "train: {train_iters: 5}\nmodel: {moe_router_topk: 4}\n", 1, "model.moe_router_topk"),
    ("ep-without-experts", "train: {train_iters: 5}\nmodel: {expert_model_parallel_size: 2}\n", 2,
     "model.expert_model_parallel_size"),
    ("freq-list-length", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, moe_layer_freq: [1, 0, 1]"), 1,
     "model.moe_layer_freq"),
    ("freq-list-no-moe", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, moe_layer_freq: [0, 0]"), 1,
     "model.moe_layer_freq"),
    ("freq-above-layers", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, moe_layer_freq: 3"), 1,
     "model.moe_layer_freq"),
    ("coeff-without-balancing", MOE.replace(
        "num_moe_experts: 4", "num_moe_experts: 4, moe_router_load_balancing_type: none, moe_aux_loss_coeff: 0.01"),
     1, "model.moe_aux_loss_coeff"),
    ("bad-balancing-type", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, moe_router_load_balancing_type: "
                                       "sinkhorn"), 1, "model.moe_router_load_balancing_type"),
    ("tp-needs-sequence-parallel", MOE.replace(
        "num_moe_experts: 4", "num_moe_experts: 4, tensor_model_parallel_size: 2"), 2, "model.sequence_parallel"),
    ("expert-ffn-not-div-tp", MOE.replace(
        "num_moe_experts: 4", "num_moe_experts: 4, tensor_model_parallel_size: 2, sequence_parallel: true, "
                              "moe_ffn_hidden_size: 33"), 2, "model.moe_ffn_hidden_size"),
    ("per-layer-logging-without-loss", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, "
                                                   "moe_per_layer_logging: true"), 1, "model.moe_per_layer_logging"),
    ("kubetron-format-at-ep2", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, expert_model_parallel_size: 2")
     + "checkpoint: {ckpt_format: kubetron}\n", 2, "checkpoint.ckpt_format"),
    ("distributed-optimizer-at-ep2", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, "
                                                 "expert_model_parallel_size: 2") + "ddp: {use_distributed_optimizer: "
                                                                                    "true}\n", 2,
     "ddp.use_distributed_optimizer"),
    ("overlap-grad-reduce-at-ep2", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, "
                                               "expert_model_parallel_size: 2") + "ddp: {overlap_grad_reduce: true}\n",
     2, "ddp.overlap_grad_reduce"),
    ("grouped-gemm-local", MOE.replace("num_moe_experts: 4", "num_moe_experts: 4, moe_grouped_gemm: true, "
                                       "transformer_impl: local"), 1, "model.moe_grouped_gemm"),
]


@pytest.mark.parametrize("name, text, world, field", ERRORS, ids=[e[0] for e in ERRORS])
def test_config_errors_are_one_line(tmp_path, capsys, monkeypatch, name, text, world, field):
    monkeypatch.setenv("KUBETRON_TERMINATION_LOG", str(tmp_path / "termination-log"))
    path = tmp_path / "config.yaml"
    path.write_text(text)
    rc = main(["config", "--config", str(path), "--world-size", str(world)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"kubetron: error: {field}"), err
