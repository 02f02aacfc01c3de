"""Mixture of experts (megatron-core's MoE layers): the config's one-line errors (training and
checkpoints: tests/test_moe_expert_parallel.py)."""

from __future__ import annotations

import pytest
from kubetron.cli import main

pytestmark = pytest.mark.unit

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


@pytest.mark.parametrize("change, field", [({"num_moe_experts": 8}, "model.num_moe_experts"),
                                           ({"num_moe_experts": None}, "model.num_moe_experts"),
                                           ({"moe_layer_freq": [0, 1]}, "model.moe_layer_freq"),
                                           ({"moe_shared_expert_intermediate_size": 32},
                                            "model.moe_shared_expert_intermediate_size")])
def test_resume_names_the_moe_field_that_differs(change, field):
    """Resume asserts what it restores: an MoE checkpoint's experts, expert sizes and layer pattern."""
    from kubetron.checkpoint.layout import arch_record, check_architecture
    from kubetron.config import ConfigContainer
    from kubetron.contract.errors import ConfigError

    def model(**kw):
        m = {"num_moe_experts": 4, "add_bias_linear": False, **kw}
        return ConfigContainer.from_dict({"train": {"train_iters": 5}, "model": m}).derive()

    with pytest.raises(ConfigError) as e:
        check_architecture(arch_record(model().model), model(**change), "iter_0000005")
    assert e.value.field == field, str(e.value)


def test_flops_count_the_router_and_the_routed_experts():
    """Throughput (TFLOP/s) of an MoE model counts what a token meets: top-2 experts of half the dense
    MLP's size and the router (2*h*E per token per MoE layer, forward; x3 with backward) in layer 2 of 2."""
    from kubetron.config import ConfigContainer
    from kubetron.training.utils import num_floating_point_operations

    def flops(**kw):
        cfg = ConfigContainer.from_dict({"train": {"train_iters": 5}, "model": {"ffn_hidden_size": 256, **kw}})
        return num_floating_point_operations(cfg.derive(), batch_size=2)

    moe = flops(num_moe_experts=8, moe_ffn_hidden_size=128, moe_layer_freq=[0, 1], add_bias_linear=False)
    assert moe - flops(add_bias_linear=False) == 3 * 64 * 2 * (2 * 64 * 8)  # s * b * 2*h*E


def test_kubetron_format_optimizer_state_goes_to_the_expert_of_its_global_number(monkeypatch):
    """A canonical (kubetron-format) optimizer state resumed at EP=2: EP rank 1's local expert 0 is global
    expert 2, and takes expert 2's state (names and the canonical/local mapping: canonical.py)."""
    import types

    import torch
    from kubetron.checkpoint import canonical
    from megatron.core import parallel_state

    class Expert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_fc1 = torch.nn.Linear(2, 2, bias=False)

    class Chunk(torch.nn.Module):  # the parts of a GPTModel the mapping reads: layers, numbering, experts
        def __init__(self):
            super().__init__()
            layer = torch.nn.Module()
            layer.layer_number = 1
            layer.mlp = torch.nn.Module()
            layer.mlp.experts = torch.nn.Module()
            layer.mlp.experts.local_experts = torch.nn.ModuleList([Expert(), Expert()])
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([layer])
            self.config = types.SimpleNamespace(num_moe_experts=4, num_layers=1)

    for name, value in (("get_tensor_model_parallel_world_size", 1), ("get_pipeline_model_parallel_world_size", 1),
                        ("get_expert_model_parallel_world_size", 2), ("get_expert_model_parallel_rank", 1)):
        monkeypatch.setattr(parallel_state, name, lambda value=value: value)
    key = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    saved = {"state": {key.format(e): {"exp_avg": torch.full((2, 2), float(e))} for e in range(4)},
             "param_groups": []}
    state = canonical.scatter_optimizer_state([Chunk()], saved)["state"]
    assert sorted(state) == [key.format(0), key.format(1)]
    assert state[key.format(0)]["exp_avg"].eq(2).all() and state[key.format(1)]["exp_avg"].eq(3).all()


@pytest.mark.trainer
def test_a_second_moe_model_in_the_process_with_more_layers_trains():
    """megatron keeps one load-balancing-loss tracker per process, sized by the first MoE model's layers: a
    deeper model built next (another run in a notebook, the next test) indexed past it (IndexError)."""
    import torch
    from kubetron.training.model import build_model

    from tests.inprocess import ensure_world_of_one, in_process_config

    ensure_world_of_one()
    for layers in (2, 4):
        cfg = in_process_config(f"model.num_layers={layers}", "model.num_moe_experts=4", "model.add_bias_linear=false",
                                "model.moe_aux_loss_coeff=0.01")
        cfg.finalize(world_size=1)
        model = build_model(cfg, torch.device("cpu"))[0]
        tokens = torch.randint(0, 250, (2, cfg.model.seq_length), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(cfg.model.seq_length).expand(2, -1)
        model(tokens, pos, None, labels=tokens).mean().backward()
