"""A Qwen3-like model (per-head q/k RMSNorm, head size 24 != hidden / heads, GQA): its config checks
and FLOPs, and trained through the real CLI: at TP=2 under torchrun (gloo) it follows the TP=1 run,
and its checkpoint (the default sharded format) resumes at TP=1.

The q/k norm weights are replicated over TP while each TP rank normalizes only its own heads, so their
gradient is the sum over the TP group (as megatron's finalize_model_grads does). Measured on CPU over
30 iterations, TP=2 vs TP=1: losses within 4.8e-7 and q/k norm weights within 1e-6 with that sum;
without it 1.4e-4 and 1e-2 (the weights moved 1.5e-2 from 1). The resumed run: within LOSS_TOL of
tests/multirank/runner.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_utils import config_for
from tests.inprocess import ensure_world_of_one
from tests.multirank.runner import LOSS_TOL, TP2, args, close, launch, ok, tb_scalars

pytestmark = pytest.mark.process

ITERS = 30
QWEN3 = ["model.normalization=RMSNorm", "model.activation=swiglu", "model.num_query_groups=2",
         "model.kv_channels=24", "model.qk_layernorm=true", "model.share_embeddings_and_output_weights=false",
         "model.vocab_size=512", f"train.train_iters={ITERS}"]  # vocab: the same init at TP=1 and 2


def test_qwen3_like_tp2_follows_tp1_and_resumes_at_tp1(tmp_path):
    tp1 = launch(args(tmp_path / "tp1", *QWEN3), tmp_path / "ranks-tp1", nproc=1)
    ok(tp1, nproc=1)
    tp2 = launch(args(tmp_path / "tp2", *QWEN3, *TP2, "checkpoint.save_interval=15"), tmp_path / "ranks-tp2")
    ok(tp2)
    ref, loss = tb_scalars(tmp_path / "tp1" / "tb"), tb_scalars(tmp_path / "tp2" / "tb")
    assert sorted(loss) == list(range(1, ITERS + 1))
    assert loss[ITERS] < loss[1] - 0.3, loss
    close(loss, ref, range(1, ITERS + 1), 1e-5)
    norms = {run: _qk_norms(tmp_path / run) for run in ("tp1", "tp2")}
    assert len(norms["tp1"]) == 4 and all((w - 1).abs().max() > 1e-3 for w in norms["tp1"].values())  # trained
    diff = max((norms["tp2"][k] - norms["tp1"][k]).abs().max().item() for k in norms["tp1"])
    print(f"q/k norm weights after {ITERS} iterations, TP=2 vs TP=1: max abs diff {diff:.3g}")
    assert diff <= 1e-5

    resumed = launch(args(tmp_path / "tp1-resumed", *QWEN3, "checkpoint.ckpt_step=15", load=tmp_path / "tp2"),
                     tmp_path / "ranks-resumed", nproc=1)
    ok(resumed, nproc=1)
    assert "at iteration 15" in resumed.stdout, resumed.tail()
    after = tb_scalars(tmp_path / "tp1-resumed" / "tb")
    assert sorted(after) == list(range(16, ITERS + 1))
    close(after, loss, range(16, ITERS + 1), LOSS_TOL)


def _qk_norms(run) -> dict[str, torch.Tensor]:
    """The q/k norm weights of a run's last checkpoint (canonical, gathered from any layout)."""
    from kubetron.hf.io import read_checkpoint

    tensors = read_checkpoint(str(run))[1]
    return {k: t for k, t in tensors.items() if ".q_layernorm." in k or ".k_layernorm." in k}


def test_head_size_is_kv_channels_in_config_checks_and_flops():
    """kv_channels frees the head size from hidden/heads (hidden 60 with 8 heads of 24); an odd head size is
    refused naming kv_channels; the FLOPs count the projections as they are (cross-checked against the
    built model's weights: 6 FLOPs per weight and token, plus attention)."""
    from kubetron.contract.errors import ConfigError
    from kubetron.training.model import build_model
    from kubetron.training.utils import num_floating_point_operations

    keys = {"num_layers": 2, "hidden_size": 60, "num_attention_heads": 8, "num_query_groups": 2, "kv_channels": 24,
            "qk_layernorm": True, "normalization": "RMSNorm", "activation": "swiglu", "ffn_hidden_size": 96,
            "vocab_size": 512, "seq_length": 32, "share_embeddings_and_output_weights": False,
            "add_bias_linear": False}
    with pytest.raises(ConfigError, match="model.hidden_size: 60 is not divisible by num_attention_heads = 8"):
        config_for({**keys, "kv_channels": None})
    with pytest.raises(ConfigError, match="model.kv_channels: rope needs an even head size, not 23"):
        config_for({**keys, "kv_channels": 23})
    cfg = config_for(keys)
    ensure_world_of_one()
    model = build_model(cfg, torch.device("cpu"))[0]
    weights = sum(p.numel() for n, p in model.named_parameters() if n.endswith("weight") and p.ndim == 2
                  and "word_embeddings" not in n)
    layer = model.decoder.layers[0].self_attention
    assert layer.q_layernorm.weight.shape == layer.k_layernorm.weight.shape == (24,)
    s, attention = 32, 2 * 32 * 8 * 24  # per token and layer: QK^T and AV, causal half
    assert num_floating_point_operations(cfg, 3) == 3 * (2 * weights + 2 * attention) * s * 3
