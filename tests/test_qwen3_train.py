"""A Qwen3-like model (per-head q/k RMSNorm, head size 24 != hidden 64 / 4 heads, GQA) trained through
the real CLI: at TP=2 under torchrun (gloo) it follows the TP=1 run, and its checkpoint (the default
sharded format) resumes at TP=1.

The q/k norm weights are replicated over TP while each TP rank normalizes only its own heads, so their
gradient is the sum over the TP group (as megatron's finalize_model_grads does). Measured on CPU over
30 iterations, TP=2 vs TP=1: losses within 4.8e-7 and q/k norm weights within 1e-6 with that sum;
without it 1.4e-4 and 1e-2 (the weights moved 1.5e-2 from 1). The resumed run: within LOSS_TOL of test_multirank.py.
"""

from __future__ import annotations

import torch

from tests.multirank.runner import launch, tb_scalars
from tests.test_multirank import LOSS_TOL, TP2, args, close, ok

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
