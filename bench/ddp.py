"""Data-parallel variants side by side: step time and optimizer memory per rank (ddp.* options).

    .venv/bin/python bench/ddp.py [--nproc 2] [--layers 4 --hidden 256 --seq 128 --mbs 4 --gbs 16]
                                  [--steps 5 --reps 6] [--bf16] [--bucket-size N]

Re-launches itself under `torchrun --nproc-per-node NPROC` (gloo on CPU, NCCL on GPU). Every rank
builds four copies of the same model (same seed), one per variant, as `kubetron train` does:

  * plain:            gradients all-reduced as one flat bucket after backward (the default)
  * overlap:          ddp.overlap_grad_reduce (bucketed buffers, async all-reduce during backward)
  * distopt:          ddp.use_distributed_optimizer (ZeRO-1: reduce-scatter, sharded state, all-gather)
  * distopt+overlap:  distopt with overlap_grad_reduce and overlap_param_gather
  * on CUDA also megatron, megatron-distopt, megatron-dist+ovl: megatron-core's DDP and optimizers

and trains them in interleaved blocks of `--steps` iterations through kubetron's `train_step`.
Printed on rank 0: median ms/step and the ratio to plain; optimizer memory on that rank (Adam
state + fp32 main weights that are not the model's own parameters) and the ratio to plain; the
loss after the last block, which must agree across variants (they train the same model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "trainer"))

VARIANTS = {
    "plain": ["ddp.impl=kubetron"],
    "overlap": ["ddp.impl=kubetron", "ddp.overlap_grad_reduce=true"],
    "distopt": ["ddp.impl=kubetron", "ddp.use_distributed_optimizer=true"],
    "distopt+overlap": ["ddp.impl=kubetron", "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true",
                        "ddp.overlap_param_gather=true"],
}
# On CUDA also megatron-core's DistributedDataParallel + optimizers (ddp.impl=megatron, the GPU default).
MEGATRON_VARIANTS = {
    "megatron": ["ddp.impl=megatron"],
    "megatron-distopt": ["ddp.impl=megatron", "ddp.use_distributed_optimizer=true"],
    "megatron-dist+ovl": ["ddp.impl=megatron", "ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true",
                          "ddp.overlap_param_gather=true"],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--bucket-size", type=int, default=None, help="ddp.bucket_size (elements)")
    return p.parse_args(argv)


def optimizer_bytes(optimizer, model) -> int:
    """Optimizer state plus optimizer-owned parameter copies (fp32 mains, fragments) on this rank."""
    inner = optimizer
    while hasattr(inner, "inner"):
        inner = inner.inner
    own = {id(p) for chunk in model for p in chunk.parameters()}
    total = sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values()
                if hasattr(v, "numel") and v.dim() > 0)
    total += sum(p.numel() * p.element_size() for g in inner.param_groups for p in g["params"] if id(p) not in own)
    return total


def worker(args) -> int:
    import logging
    import warnings

    import torch
    from kubetron.compat import megatron_core

    megatron_core.install()  # as `kubetron train` does, before anything imports megatron-core
    from megatron.core import parallel_state

    warnings.filterwarnings("ignore")
    logging.getLogger("kubetron").setLevel(logging.WARNING)
    from kubetron.config import ConfigContainer
    from kubetron.data import build_data_iterators
    from kubetron.training.entry import initialize_distributed, set_seeds
    from kubetron.training.gpt_step import forward_step
    from kubetron.training.model import build_model, num_parameters
    from kubetron.training.optim import LRScheduler, build_optimizer
    from kubetron.training.state import GlobalState
    from kubetron.training.train import LossChecks, train_step
    from kubetron.training.utils import prepare_forward_step_func

    base = [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.num_attention_heads={args.heads}", f"model.seq_length={args.seq}",
            f"train.micro_batch_size={args.mbs}", f"train.global_batch_size={args.gbs}",
            "train.train_iters=1000000", "scheduler.lr_decay_style=constant", "scheduler.lr_warmup_iters=0",
            "checkpoint.save=null", "validation.eval_interval=null", "train.exit_signal_handler=false",
            "logger.log_progress=false", "train.status_port=0"]
    if args.bf16:
        base.append("mixed_precision.bf16=true")
    if args.bucket_size:
        base.append(f"ddp.bucket_size={args.bucket_size}")
    runs = {}
    variants = {**VARIANTS, **(MEGATRON_VARIANTS if torch.cuda.is_available() else {})}
    for i, (name, extra) in enumerate(variants.items()):
        cfg = ConfigContainer.from_yaml(str(ROOT / "examples" / "tiny-gpt.yaml"), base + extra)
        if i == 0:
            rank, world, device = initialize_distributed(cfg)
            parallel_state.initialize_model_parallel(1, 1)
        cfg.finalize(world_size=world)
        set_seeds(cfg)
        state = GlobalState(cfg=cfg)
        model = build_model(cfg, device)
        optimizer = build_optimizer(cfg, model)
        scheduler = LRScheduler(optimizer, cfg)
        train_it, _ = build_data_iterators(cfg, parallel_state.get_data_parallel_rank(),
                                           parallel_state.get_data_parallel_world_size())
        fwd = prepare_forward_step_func(forward_step, state)
        runs[name] = dict(cfg=cfg, state=state, model=model, optimizer=optimizer, scheduler=scheduler, it=train_it,
                          fwd=fwd, loss=None, times=[], checks=LossChecks(cfg))

    def steps(r, n):
        for _ in range(n):
            loss_dict = train_step(r["fwd"], r["it"], r["model"], r["optimizer"], r["scheduler"], r["state"],
                                   r["checks"]).loss_dict
            r["state"].train_state.step += 1
        r["loss"] = float(next(iter(loss_dict.values())))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        torch.distributed.barrier()

    for r in runs.values():
        steps(r, args.warmup)
    names = list(runs)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            sync()
            t0 = time.perf_counter()
            steps(runs[name], args.steps)
            sync()
            runs[name]["times"].append((time.perf_counter() - t0) * 1000 / args.steps)
    if rank == 0:
        plain = runs["plain"]
        ms0 = statistics.median(plain["times"])
        mem0 = optimizer_bytes(plain["optimizer"], plain["model"])
        nparams = num_parameters(plain["model"])
        print(f"kubetron data-parallel variants: {world} ranks ({device.type}), {args.layers} layers, hidden "
              f"{args.hidden}, seq {args.seq}, mbs {args.mbs}, gbs {args.gbs}, {nparams / 1e6:.2f}M params, "
              f"{'bf16' if args.bf16 else 'fp32'}, {args.reps} x {args.steps} steps per variant, interleaved")
        print()
        header = f"{'variant':<18}{'ms/step':>10}{'vs plain':>10}{'optimizer MB/rank':>19}{'vs plain':>10}{'loss':>12}"
        print(header)
        print("-" * len(header))
        for name, r in runs.items():
            ms = statistics.median(r["times"])
            mem = optimizer_bytes(r["optimizer"], r["model"])
            print(f"{name:<18}{ms:>10.1f}{ms / ms0:>10.3f}{mem / 2**20:>19.2f}{mem / mem0:>10.3f}{r['loss']:>12.6f}")
        print()
        print("optimizer MB/rank = Adam exp_avg/exp_avg_sq + optimizer-owned fp32 copies (mains, fragments) on "
              "rank 0; with the distributed optimizer expect ~(8+4)/dp bytes per parameter vs 8 (fp32 "
              "model) or 12 (bf16 model) without it.")
    for r in runs.values():
        r["it"].close()
    return 0


def main(argv=None) -> int:
    if os.environ.get("KUBETRON_BENCH_WORKER") == "1":
        code = worker(parse_args(json.loads(os.environ["KUBETRON_BENCH_ARGS"])))
        sys.stdout.flush()
        os._exit(code)
    args = parse_args(argv)
    # The script's own options travel in the environment: torchrun would take --nproc for its own. The
    # ranks keep the caller's PYTHONPATH (on a GPU machine it holds megatron-core: bench/gpu_wheels.py).
    pythonpath = os.pathsep.join(filter(None, [str(ROOT / "trainer"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "KUBETRON_BENCH_WORKER": "1", "PYTHONPATH": pythonpath,
           "KUBETRON_BENCH_ARGS": json.dumps(sys.argv[1:] if argv is None else list(argv))}
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--master-port",
           str(port), __file__]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
