"""`kubetron plan`: the memory estimate against bytes measured on CPU, the recipes at their stated sizes,
and the command as a user runs it."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kubetron.config import GPTModelConfig
from kubetron.errors import ConfigError
from kubetron.plan import GIB, make_plan, parse_memory
from tests.test_forward_step import ensure_world_of_one, in_process_config

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
PLAN_LINE = re.compile(r"^# plan: (.+)$", re.M)
TOLERANCE = 0.15


# --- measured on CPU ----------------------------------------------------------------------------------

def _live_tensor_bytes() -> dict[int, int]:
    """{storage pointer: bytes} of every tensor Python can reach (parameters, grads, optimizer state)."""
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            st = obj.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


class _Held:
    """What the graph keeps for one saved tensor: releases its bytes from the count when dropped."""

    def __init__(self, count: _SavedBytes, ptr: int, t: torch.Tensor):
        self.count, self.ptr, self.t = count, ptr, t

    def __del__(self):
        self.count.release(self.ptr)


class _SavedBytes:
    """Peak of the unique storage bytes the autograd graph holds for backward (parameters excluded),
    over the forward and the backward pass (where recomputed layers save theirs again)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.current = self.peak = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params:
            return t
        entry = self.live.setdefault(ptr, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(self, ptr, t)

    def release(self, ptr: int):
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held


def measure(*overrides: str) -> tuple[dict[str, int], object]:
    """Train a tiny fp32 model for two steps on CPU; return the measured bytes and the config.

    static: every tensor alive after the steps, minus those alive before the model was built.
    activations: the peak of the bytes held for backward during the last step.
    """
    from kubetron.training.entry import set_seeds
    from kubetron.training.model import build_model
    from kubetron.training.optim import build_optimizer

    ensure_world_of_one()
    cfg = in_process_config("train.micro_batch_size=2", "train.global_batch_size=2", *overrides)
    cfg.finalize()
    set_seeds(cfg)
    gc.collect()
    before = _live_tensor_bytes()
    model = build_model(cfg, torch.device("cpu"))
    opt = build_optimizer(cfg, model)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, 258, (b, s), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(s).expand(b, s)
    for _ in range(2):
        saved = _SavedBytes(model[0])
        opt.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = model[0](tokens, pos, None, labels=tokens.roll(-1, 1)).mean()
            loss.backward()
        opt.finish_grad_sync()
        opt.step()
    assert saved.current == 0  # every saved tensor was released by the backward pass
    del loss
    gc.collect()
    static = sum(n for ptr, n in _live_tensor_bytes().items() if ptr not in before)
    return {"static": static, "activations": saved.peak,
            "params": sum(p.numel() for p in model[0].parameters())}, cfg


SHAPES = {
    "gpt-layernorm-gelu": ["model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=4",
                           "model.seq_length=256"],
    "llama-gqa-swiglu": ["model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=8",
                         "model.num_query_groups=2", "model.ffn_hidden_size=352", "model.seq_length=256",
                         "model.normalization=RMSNorm", "model.activation=swiglu", "model.add_bias_linear=false",
                         "model.share_embeddings_and_output_weights=false"],
}
RECOMPUTE = {
    "off": [],
    "selective": ["model.recompute_granularity=selective"],
    "full-uniform-2": ["model.recompute_granularity=full", "model.recompute_method=uniform",
                       "model.recompute_num_layers=2"],
    "full-block-1": ["model.recompute_granularity=full", "model.recompute_method=block",
                     "model.recompute_num_layers=1"],
}


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_estimate_matches_the_bytes_measured_on_cpu(shape, recompute):
    measured, cfg = measure(*SHAPES[shape], *RECOMPUTE[recompute])
    plan = make_plan(cfg, world_size=1)
    st = plan.stage
    assert plan.parameters["total"] == measured["params"] == st.params  # exact, not estimated
    static = st.weights + st.gradients + st.optimizer
    assert static == pytest.approx(measured["static"], rel=TOLERANCE), (static, measured)
    assert st.activations == pytest.approx(measured["activations"], rel=TOLERANCE), (st.activations, measured)
    assert st.total == pytest.approx(measured["static"] + measured["activations"], rel=TOLERANCE)
