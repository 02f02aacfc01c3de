"""The GPU path, as far as it runs on CPU: `ddp.impl` selection, collectives on the backend's device,
activation recompute (model.recompute_*), and the judges of `make gpu-check`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from kubetron.contract.errors import ConfigError

from tests.inprocess import ensure_world_of_one, in_process_config
from tests.trainer_utils import bench_module

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent


# --- ddp.impl ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl, device, expected", [
    ("auto", "cpu", "kubetron"), ("auto", "cuda", "megatron"), ("kubetron", "cuda", "kubetron"),
    ("kubetron", "cpu", "kubetron"), ("megatron", "cuda", "megatron")])
def test_ddp_impl_resolution(impl, device, expected):
    from kubetron.training.optim import resolve_ddp_impl

    cfg = in_process_config(f"ddp.impl={impl}")
    assert resolve_ddp_impl(cfg, torch.device(device)) == expected


def test_ddp_impl_megatron_on_cpu_is_a_one_line_config_error(tmp_path, capsys):
    from kubetron.cli import main
    from kubetron.training.optim import resolve_ddp_impl

    with pytest.raises(ConfigError, match="ddp.impl"):
        resolve_ddp_impl(in_process_config("ddp.impl=megatron"), torch.device("cpu"))
    ensure_world_of_one()
    rc = main(["train", "--config", str(ROOT / "examples" / "tiny-gpt.yaml"), "ddp.impl=megatron",
               "train.train_iters=20", "checkpoint.save=null", "train.exit_signal_handler=false",
               f"train.termination_log={tmp_path / 'term'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kubetron: error: ddp.impl: megatron needs CUDA"), err
    with pytest.raises(ConfigError, match="ddp.impl"):
        in_process_config("ddp.impl=megatron", "dist.use_gpu=false").finalize()


def test_megatron_configs_follow_kubetron_sections():
    """What megatron-core's DDP and optimizer get (their construction needs CUDA: make gpu-check)."""
    from kubetron.training.megatron_ddp import ddp_config, optimizer_config

    cfg = in_process_config("ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true",
                            "ddp.bucket_size=1000", "mixed_precision.bf16=true", "optimizer.clip_grad=0.5")
    cfg.finalize()
    d, o = ddp_config(cfg), optimizer_config(cfg)
    assert (d.use_distributed_optimizer, d.overlap_grad_reduce, d.bucket_size, d.grad_reduce_in_fp32) == \
        (True, True, 1000, True)
    assert (o.use_distributed_optimizer, o.bf16, o.params_dtype, o.clip_grad, o.lr) == \
        (True, True, torch.bfloat16, 0.5, cfg.optimizer.lr)
    assert o.decoupled_weight_decay and o.weight_decay == cfg.optimizer.weight_decay


# --- collectives on the backend's device -------------------------------------------------------------

def test_collective_device_follows_the_backend(monkeypatch):
    from kubetron.checkpoint import comm

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert comm.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert comm.collective_device() == torch.device("cpu")


def test_any_rank_reduces_on_the_collective_device(monkeypatch):
    """comm.any_rank (the checkpoint manager's signal and exit flags, the straggler's) puts its tensor where the
    group's backend wants it: asked of collective_device, not a bare CPU tensor."""
    from kubetron.checkpoint import comm

    asked, seen = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(comm, "collective_device", lambda group=None: asked.append(group) or torch.device("meta"))

    def fake_all_reduce(t, op=None, group=None):  # the other rank raised the flag
        seen.append(t.device)
        raise _Done
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    with pytest.raises(_Done):
        comm.any_rank(False)
    assert asked == [None] and seen == [torch.device("meta")]


class _Done(Exception):
    pass


def test_no_bare_cpu_tensors_reach_collectives_in_the_loop():
    """The loop's and optimizers' flag/counter collectives go through comm (grep, so a new bare one fails)."""
    for name in ("train.py", "utils.py", "optim.py", "optimizer_base.py", "grads.py", "ddp.py"):
        text = (ROOT / "trainer" / "kubetron" / "training" / name).read_text()
        assert "dtype=torch.int32)\n" not in text and "dtype=torch.float64)\n" not in text, name


# --- activation recompute ----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (["model.recompute_method=uniform"], "model.recompute_method"),
    (["model.recompute_granularity=full", "model.recompute_num_layers=1"], "model.recompute_method"),
    (["model.recompute_granularity=full", "model.recompute_method=block"], "model.recompute_num_layers"),
    (["model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=3"],
     "model.recompute_num_layers"),
    (["model.recompute_granularity=selective", "model.recompute_method=block"], "model.recompute_method"),
])
def test_recompute_combinations_are_checked(overrides, field):
    with pytest.raises(ConfigError) as e:
        in_process_config(*overrides).finalize()
    assert e.value.field == field


def _train_tiny(overrides, steps=3):
    """Losses of `steps` AdamW steps on fixed batches; forward calls of layer 0's MLP and core attention."""
    from kubetron.training.entry import set_seeds
    from kubetron.training.model import build_model
    from kubetron.training.optim import build_optimizer

    ensure_world_of_one()
    cfg = in_process_config("model.num_layers=2", "model.seq_length=32", *overrides)
    cfg.finalize()
    set_seeds(cfg)
    model = build_model(cfg, torch.device("cpu"))
    layer = model[0].decoder.layers[0]
    calls = {"mlp": 0, "attn": 0}
    layer.mlp.register_forward_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1))
    layer.self_attention.core_attention.register_forward_hook(
        lambda *a: calls.__setitem__("attn", calls["attn"] + 1))
    opt = build_optimizer(cfg, model)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=gen)
        pos = torch.arange(32).expand(2, 32)
        opt.zero_grad()
        loss = model[0](tokens, pos, None, labels=tokens.roll(-1, 1)).float().mean()
        loss.backward()
        opt.finish_grad_sync()
        opt.clip_grad_norm(1.0)
        opt.step()
        losses.append(loss.item())
    return losses, calls


def test_recompute_gives_the_same_losses_and_really_recomputes():
    base, calls = _train_tiny([])
    assert calls == {"mlp": 3, "attn": 3}
    full, calls = _train_tiny(["model.recompute_granularity=full", "model.recompute_method=uniform",
                               "model.recompute_num_layers=1"])
    assert full == base and calls == {"mlp": 6, "attn": 6}  # each layer's forward runs again in backward
    block, calls = _train_tiny(["model.recompute_granularity=full", "model.recompute_method=block",
                                "model.recompute_num_layers=1"])
    assert block == base and calls == {"mlp": 6, "attn": 6}  # block: layer 0 of the stage is recomputed
    selective, calls = _train_tiny(["model.recompute_granularity=selective"])
    assert selective == base and calls == {"mlp": 3, "attn": 6}  # only core attention again


# --- make gpu-check's judges (the dry run itself: tests/test_gpu_layout.py) ------------------------------

def _variants(ours_ms=244.2, ours_tps=524.0, base_ms=29.8, base_tps=4295.0, mfu=0.0):
    """gpu_step.py's rows as parsed (a tiny CPU run: 128 tokens a step): step ms, tokens/s, TFLOP/s, MFU, GiB."""
    nan = float("nan")
    return {"kubetron train() end to end": [ours_ms, ours_tps, 0.0, mfu, nan],
            "plain PyTorch eager": [base_ms, base_tps, 0.0, 0.0, nan]}


@pytest.mark.parametrize("ratio, variants, result", [
    (0.122, _variants(), "DRY"),                                            # measured under load
    (1.045, _variants(1252.2, 102, 1309.0, 98), "DRY"),
    (0.562, _variants(9.0, 14286.0, 5.0, 25397.0), "DRY"),                  # quiet CPU: 8.96, 5.04 ms shown 9.0, 5.0
    (float("nan"), _variants(), "FAIL"),                                    # the ratio not computed
    (0.122, _variants(ours_tps=float("inf")), "FAIL"),
    (0.0, _variants(ours_ms=float("inf"), ours_tps=0.0), "FAIL"),           # kubetron made no progress
    (0.122, _variants(ours_tps=5240.0), "FAIL"),                            # tokens/s off by 10x: a unit slip
    (0.5, _variants(), "FAIL"),                                             # the ratio is not the rows' ratio
    (0.122, _variants(mfu=150.0), "FAIL"),                                  # MFU above 100 %
    (0.014, _variants(2128.6, 60.1, 29.8, 4295.0), "DRY"),                  # measured at load 5-7
    (1000.0, _variants(0.298, 429530.0, 298.0, 430.0), "FAIL"),             # outside the dry run's bounds
    (0.001, _variants(29800.0, 4.3, 29.8, 4295.0), "FAIL"),
])
def test_gpu_check_dry_run_fails_a_speed_row_with_insane_figures(ratio, variants, result):
    gpu_check = bench_module("gpu_check")
    assert gpu_check.judge_gpu_step(ratio, variants, 128, tiny=True).result == result


def test_gpu_check_keeps_the_gpu_targets():
    gpu_check = bench_module("gpu_check")
    assert gpu_check.judge_gpu_step(1.045, _variants(1252.2, 102, 1309.0, 98), 128, tiny=False).result == "FAIL"
    assert gpu_check.judge_gpu_step(1.2, _variants(100.0, 1280.0, 120.0, 1067.0), 128, tiny=False).result == "PASS"
    assert gpu_check.judge_checkpoint(1.5, 9.0, tiny=False).result == "FAIL"
    assert gpu_check.judge_checkpoint(0.4, 9.0, tiny=False).result == "PASS"


@pytest.mark.parametrize("blocked, durable, result", [
    (0.25, 0.31, "DRY"), (0.85, 0.92, "DRY"),
    (0.9, 0.3, "FAIL"),                    # waited longer than the whole save took: a broken timer
    (-0.1, 0.3, "FAIL"), (float("nan"), 0.3, "FAIL"), (0.0, 0.0, "FAIL"),
    (6.0, 7.0, "FAIL"),                    # seconds for 16 MB: outside the dry run's bound
])
def test_gpu_check_dry_run_fails_a_checkpoint_row_with_insane_figures(blocked, durable, result):
    assert bench_module("gpu_check").judge_checkpoint(blocked, durable, tiny=True).result == result


@pytest.mark.parametrize("rc, losses, result", [
    (0, {1: 5.58, 2: 5.4, 3: 5.1}, "PASS"),
    (1, {1: 5.58, 2: 5.4, 3: 5.1}, "FAIL"),
    (0, {1: 5.58, 2: 5.4, 3: 5.9}, "FAIL"),                # the loss did not fall
    (0, {1: 5.58, 2: float("nan"), 3: 5.1}, "FAIL"),
    (0, {1: 5.58, 3: 5.1}, "FAIL"),                        # an iteration without a loss
])
def test_gpu_check_pp2_row_is_judged(rc, losses, result):
    assert bench_module("gpu_check").judge_pp2(rc, losses, 3, "2 CPU ranks (gloo)").result == result


@pytest.mark.parametrize("losses, tokens_per_s, result", [
    ({1: 5.59, 2: 5.3, 3: 5.04}, {1: 0.0, 2: 181.1, 3: 243.0}, "PASS"),  # the first iteration has no timing yet
    ({1: 5.59, 2: 5.3, 3: 5.04}, {1: 0.0, 2: 181.1, 3: 0.0}, "FAIL"),    # a stalled iteration
    ({1: 5.59, 2: 5.3, 3: 5.04}, {1: 0.0, 2: float("nan"), 3: 243.0}, "FAIL"),
    ({1: 5.59, 2: 5.3, 3: 5.04}, {}, "FAIL"),                            # no throughput logged
    ({1: 5.59, 2: 5.3, 3: 5.7}, {1: 0.0, 2: 181.1, 3: 243.0}, "FAIL"),   # the loss did not fall
])
def test_gpu_check_moe_row_is_judged_with_its_throughput(losses, tokens_per_s, result):
    row = bench_module("gpu_check").judge_run("MoE EP=1 train", 0, losses, 3, "1 GPU(s)", tokens_per_s)
    assert row.result == result and "tokens/s" in row.target


def test_gpu_check_moe_ep2_row_skips_on_one_gpu():
    row = bench_module("gpu_check").check_moe(tiny=False, gpus=1, ep=2)
    assert (row.name, row.result, row.figure) == ("MoE EP=2 all-to-all", "SKIP", "needs 2 GPUs, found 1")
