"""GPU fast path (issue 7): kubetron end to end vs a plain-PyTorch + torch.compile GPT, one run.

    python bench/gpu_step.py                 # on a GPU machine: examples/gpt-1p3b.yaml's shape
    python bench/gpu_step.py --tiny          # CPU smoke run of the same code paths (tiny shape)

Prints, for each variant, steady-state step time, tokens/s, TFLOP/s, MFU (against --peak-tflops,
default 989 = H100 SXM dense bf16) and peak memory, then the ratio kubetron / baseline, and the
trainer's memory report (MEMORY_KEYS). Both variants count FLOPs with the same formula
(kubetron.training.utils.num_floating_point_operations) on the same shape and the same mock data.
kubetron is measured end to end: `train()` with its data loader, logging and metrics, after warm-up.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "trainer"))

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
        "tokenizer.vocab_size=512", "train.micro_batch_size=2", "train.global_batch_size=2",
        "model.compile=false", "mixed_precision.bf16=false", "logger.log_interval=5"]


# --- the baseline: a plain PyTorch GPT of the same shape -------------------------------------------
class Block(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.fc1 = nn.Linear(h, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):  # x: (b, s, h)
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def rope(x, cos, sin):  # x: (b, s, heads, d)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, h: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, heads, 4 * h) for _ in range(layers))
        self.ln = nn.LayerNorm(h)
        d = h // heads
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(seq).float(), inv)  # (s, d/2)
        self.register_buffer("cos", freqs.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", freqs.sin()[None, :, None, :], persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.ln(x) @ self.emb.weight.t()  # tied output layer
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def run_baseline(cfg, device, steps: int, warmup: int, compile_model: bool):
    from kubetron.data import build_data_iterators

    m = cfg.model
    model = PlainGPT(m.vocab_size, m.hidden_size, m.num_attention_heads, m.num_layers, m.seq_length).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, fused=device.type == "cuda")
    step_fn = torch.compile(model) if compile_model else model
    train_it, _ = build_data_iterators(cfg, 0, 1)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision.bf16)
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        for _ in range(cfg.train.num_microbatches):
            b = next(train_it)
            with amp:
                loss = step_fn(b["tokens"].to(device, non_blocking=True), b["labels"].to(device, non_blocking=True))
            (loss / cfg.train.num_microbatches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    train_it.close()
    return sorted(times[warmup:])[len(times[warmup:]) // 2], loss.item()


def run_kubetron(cfg, steps: int, warmup: int):
    """End to end through the trainer; steady-state step time from the run's step events (the last `steps`)."""
    from kubetron.events import StepDone
    from kubetron.training import entry
    from kubetron.training.gpt_step import forward_step

    cfg.train.train_iters = warmup + steps
    done: list[tuple[int, float]] = []  # (iteration, when it was done)

    def record(event):
        if isinstance(event, StepDone):
            done.append((event.iteration, time.perf_counter()))

    code = entry._run(cfg, forward_step, "pretrain", listeners=[record])
    assert code == 0, f"trainer exited {code}"
    (i0, t0), (i1, t1) = done[-steps - 1], done[-1]
    return (t1 - t0) / (i1 - i0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "examples" / "gpt-1p3b.yaml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU: checks the script, measures nothing")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("gpu_step: no CUDA device here; run it on a GPU machine (or --tiny for a CPU smoke run)")
        return 0
    from kubetron.compat import megatron_core

    megatron_core.install()  # as `kubetron train` does, before anything imports megatron-core
    from kubetron.config import ConfigContainer
    from kubetron.training.utils import MEMORY_KEYS, num_floating_point_operations, report_memory

    overrides = (TINY if args.tiny else []) + args.overrides
    def make_cfg():
        cfg = ConfigContainer.from_yaml(args.config, overrides)
        cfg.finalize(world_size=1)
        return cfg

    device = torch.device("cuda" if cuda else "cpu")
    cfg = make_cfg()
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    flops = num_floating_point_operations(cfg, cfg.train.global_batch_size)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"gpu_step on {name}: layers={cfg.model.num_layers} hidden={cfg.model.hidden_size} "
          f"heads={cfg.model.num_attention_heads} seq={cfg.model.seq_length} gbs={cfg.train.global_batch_size} "
          f"bf16={cfg.mixed_precision.bf16} compile={cfg.model.compile}; {flops / 1e12:.2f} TFLOP per step")
    rows = []

    def record(label, seconds):
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        tflops = flops / seconds / 1e12
        rows.append((label, seconds * 1e3, tokens / seconds, tflops, 100 * tflops / args.peak_tflops, peak))

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    record("kubetron train() end to end", run_kubetron(make_cfg(), args.steps, args.warmup))
    mem = report_memory(MEMORY_KEYS)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_s, _ = run_baseline(make_cfg(), device, args.steps, args.warmup, compile_model=cfg.model.compile)
    record("plain PyTorch" + (" + torch.compile" if cfg.model.compile else " eager"), base_s)

    print(f"{'variant':34s} {'step ms':>9s} {'tokens/s':>11s} {'TFLOP/s':>9s} {'MFU %':>7s} {'peak GiB':>9s}")
    for label, ms, tps, tf, mfu, peak in rows:
        print(f"{label:34s} {ms:9.1f} {tps:11.0f} {tf:9.1f} {mfu:7.1f} {peak:9.2f}")
    ratio = rows[1][1] / rows[0][1]
    print(f"ratio kubetron / baseline (throughput): {ratio:.3f}   (target >= 1.13 on one H100)")
    if mem:
        print("trainer memory report (MEMORY_KEYS):")
        for k, v in mem.items():
            print(f"  {k:28s} {v / 2**30:8.2f} GiB" if "bytes" in k else f"  {k:28s} {v:8.0f}")
    return 0 if math.isfinite(ratio) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
