"""Step-time overhead of kubetron's `train()` over a bare PyTorch loop on the same model and data.

    .venv/bin/python bench/loop_overhead.py [--layers 2 --hidden 128 --seq 128 --mbs 4 --gbs 8]
                                            [--steps 10 --reps 15 --warmup 10] [--threads N]
                                            [--device cpu|cuda|auto] [--check]

Model, optimizer, scheduler and data iterator are built exactly as `kubetron train` builds them
(kubetron.training.entry / model / optim, kubetron.data, world size 1 on gloo or NCCL). Variants,
each timed over blocks of `--steps` optimizer steps:

  * bare loop:  for each micro-batch: batch -> model -> masked token loss -> backward; clip;
                optimizer.step(); scheduler.step(). No logging, no checks, no checkpoints.
  * train():    kubetron.training.train.train() (forward-step contract, loss reductions, NaN check,
                metrics, exit checks) with logger.log_interval=10, and again with log_interval=1.
  * + listener: train() at log_interval=10 with one more listener of the run's events (kubetron.events)
                that does nothing: the cost of one listener call per step.
  * + snapshots: train() at log_interval=10 taking memory snapshots (docs/recovery.md) into a directory under
                /dev/shm at the default interval (checkpoint.non_persistent_save_interval unset: as often as
                costs 2 % of the step time), as a pod with a memory volume does: issue 43's overhead row.

The variants share the model, optimizer and data, and their blocks are interleaved (the order
rotates every repetition) so machine noise hits them alike. Reported per variant: the median wall
ms/step (and min/max), and the median CPU ms/step of this process (`time.process_time`, which other
processes on a shared machine do not inflate); the ratio train()/bare (target <= 1.05) with the
per-step overhead in ms; and the cost of logging every iteration. `--check` exits 1 when the wall
ratio is above `--target`. The listener's cost is printed twice: the paired ratio of `+ listener` to train()
(wall; on a busy machine its noise is far larger than the cost), and one listener call timed alone (this process's
CPU time, the fastest of several blocks of many calls) as a share of train()'s step.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "trainer"))

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=4, help="micro-batch size")
    p.add_argument("--gbs", type=int, default=8, help="global batch size (gbs/mbs micro-batches per step)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per timed block")
    p.add_argument("--reps", type=int, default=15, help="timed blocks per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per variant first")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--target", type=float, default=1.05)
    p.add_argument("--check", action="store_true", help="exit 1 if train()/bare exceeds --target")
    return p.parse_args(argv)


def build(args):
    """Config, state and training objects, as kubetron.training.run.build_run builds them."""
    from kubetron.checkpoint.manager import CheckpointManager, open_save_store
    from kubetron.config import ConfigContainer
    from kubetron.data import build_data_iterators
    from kubetron.events import Events
    from kubetron.training.entry import initialize_distributed, set_seeds
    from kubetron.training.metrics import MetricsLogger
    from kubetron.training.model import build_model, num_parameters
    from kubetron.training.optim import LRScheduler, build_optimizer
    from kubetron.training.state import GlobalState
    from megatron.core import parallel_state

    use_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    cfg = ConfigContainer.from_yaml(str(ROOT / "examples" / "tiny-gpt.yaml"), [
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.num_attention_heads={args.heads}", f"model.seq_length={args.seq}",
        f"train.micro_batch_size={args.mbs}", f"train.global_batch_size={args.gbs}",
        "train.train_iters=1000000", "scheduler.lr_decay_style=constant", "scheduler.lr_warmup_iters=0",
        "checkpoint.save=null", "checkpoint.load=null", "validation.eval_interval=null",
        "train.exit_signal_handler=false", "logger.log_progress=false", "train.status_port=0",
        f"dist.use_gpu={'true' if use_gpu else 'false'}", "ddp.impl=kubetron",  # the bare loop steps .grad
    ])
    rank, world, device = initialize_distributed(cfg)
    cfg.finalize(world_size=world)
    parallel_state.initialize_model_parallel(1, 1)
    set_seeds(cfg)
    state = GlobalState(cfg=cfg)
    model = build_model(cfg, device)
    optimizer = build_optimizer(cfg, model)
    scheduler = LRScheduler(optimizer, cfg)
    train_it, valid_it = build_data_iterators(cfg, 0, 1)
    metrics = MetricsLogger(cfg, state, writes=True, world_size=world, rank=rank, start_time=time.time())
    events = Events([metrics])  # as kubetron.training.run builds them, without the optional ones
    ckpt = CheckpointManager(cfg, open_save_store(cfg), model=model, optimizer=optimizer, scheduler=scheduler,
                             train_state=state.train_state, data=(train_it, valid_it), run_id="bench",
                             world_size=world, events=events)
    return cfg, state, model, optimizer, scheduler, train_it, valid_it, ckpt, metrics, device, num_parameters(model)


def snapshotting_manager(cfg, state, model, optimizer, scheduler, train_it, valid_it, events, directory: str):
    """A checkpoint manager for the same run that takes memory snapshots into `directory` at the default interval
    (and saves nothing to a store), as kubetron.training.run builds it in a pod with a memory volume."""
    import copy

    from kubetron.checkpoint.manager import CheckpointManager, open_save_store

    snap_cfg = copy.deepcopy(cfg)
    snap_cfg.checkpoint.non_persistent_ckpt_type = "local"
    snap_cfg.checkpoint.non_persistent_local_ckpt_dir = directory
    snap_cfg.checkpoint.non_persistent_save_interval = None
    manager = CheckpointManager(snap_cfg, open_save_store(snap_cfg), model=model, optimizer=optimizer,
                                scheduler=scheduler, train_state=state.train_state, data=(train_it, valid_it),
                                run_id="bench-snapshots", world_size=1, events=events)
    assert manager.memory is not None, "memory snapshots are off for this config"
    manager.memory.resumed(state.train_state.step)  # what the manager's load() tells it at a run's start
    return snap_cfg, manager


def bare_steps(n, cfg, model, optimizer, scheduler, data_iterator, device):
    """The baseline: what any hand-written loop does per optimizer step, and nothing more."""
    chunk = model[0]
    nmb = cfg.train.num_microbatches
    clip = cfg.optimizer.clip_grad
    params = list(chunk.parameters())
    for _ in range(n):
        optimizer.zero_grad()
        for _ in range(nmb):
            b = next(data_iterator)
            tokens, pos, labels = (b[k].to(device, non_blocking=True) for k in ("tokens", "position_ids", "labels"))
            mask = b["loss_mask"].to(device, non_blocking=True).reshape(-1)
            out = chunk(tokens, pos, None, labels=labels)
            loss = (out.float().reshape(-1) * mask).sum() / mask.sum()
            (loss / nmb).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        scheduler.step(1)


def listener_call_seconds(blocks: int = 7, calls: int = 200_000) -> float:
    """CPU seconds one more no-op listener adds to one `Events.emit(StepDone)`: the fastest block of `calls` emits
    to two no-op listeners, less the fastest to one."""
    from kubetron.events import Events, StepDone

    event = StepDone(1, 0.1, 8, {}, 1e-3, None, False, None, 1.0)

    def per_emit(events) -> float:
        best = float("inf")
        for _ in range(blocks):
            t0 = time.process_time()
            for _ in range(calls):
                events.emit(event)
            best = min(best, (time.process_time() - t0) / calls)
        return best

    def noop(event):
        return None

    return max(per_emit(Events([noop, noop])) - per_emit(Events([noop])), 0.0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    from kubetron.compat import megatron_core

    megatron_core.install()  # as `kubetron train` does, before anything imports megatron-core
    from kubetron.events import Events
    from kubetron.training.gpt_step import forward_step
    from kubetron.training.train import train

    cfg, state, model, optimizer, scheduler, train_it, valid_it, ckpt, metrics, device, nparams = build(args)
    sink = io.StringIO()  # console lines are produced (their cost is measured) but not shown
    with_listener = Events([metrics, lambda event: None])  # one more listener, which does nothing

    import tempfile

    snap_dir = tempfile.mkdtemp(prefix="kubetron-bench-snapshots-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                else None)
    snap_cfg, snap_ckpt = snapshotting_manager(cfg, state, model, optimizer, scheduler, train_it, valid_it,
                                               Events([metrics]), snap_dir)

    def run_train(n, log_interval, events=None, manager=None):
        run_cfg = snap_cfg if manager is not None else cfg
        run_cfg.logger.log_interval = log_interval
        run_cfg.train.train_iters = state.train_state.step + n
        state.cfg = run_cfg
        with contextlib.redirect_stdout(sink):
            code = train(forward_step, model, optimizer, scheduler, train_it, valid_it, state, manager or ckpt,
                         events=events)
        state.cfg = cfg
        if code != 0:
            raise SystemExit(f"train() returned exit code {code}")
        sink.seek(0)
        sink.truncate()

    variants = {
        "bare loop": lambda n: bare_steps(n, cfg, model, optimizer, scheduler, train_it, device),
        "train(), log_interval=10": lambda n: run_train(n, 10),
        "train(), log_interval=1": lambda n: run_train(n, 1),
        "+ listener, interval=10": lambda n: run_train(n, 10, with_listener),
        "+ snapshots, interval=10": lambda n: run_train(n, 10, manager=snap_ckpt),
    }
    names = list(variants)
    for name in names:  # warm-up: allocator, autograd graph caches, prefetch thread, first log line
        variants[name](args.warmup)
    sync(device)

    per_step: dict[str, list[float]] = {n: [] for n in names}  # wall ms/step
    cpu_step: dict[str, list[float]] = {n: [] for n in names}  # this process's CPU ms/step
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            variants[name](args.steps)
            sync(device)
            per_step[name].append((time.perf_counter() - t0) * 1000.0 / args.steps)
            cpu_step[name].append((time.process_time() - c0) * 1000.0 / args.steps)

    med = {n: statistics.median(v) for n, v in per_step.items()}
    cmed = {n: statistics.median(v) for n, v in cpu_step.items()}
    bare, cbare = med["bare loop"], cmed["bare loop"]
    paired = {n: statistics.median(a / b for a, b in zip(per_step[n], per_step["bare loop"])) for n in names}

    print(f"kubetron loop overhead: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"mbs {args.mbs}, gbs {args.gbs} ({cfg.train.num_microbatches} micro-batches/step), "
          f"{nparams / 1e6:.2f}M params, device {device}, torch threads {torch.get_num_threads()}, "
          f"{args.reps} x {args.steps} steps per variant, interleaved")
    print()
    header = (f"{'variant':<26}{'wall ms/step':>13}{'min':>9}{'max':>9}{'vs bare':>9}{'paired':>8}"
              f"{'cpu ms/step':>13}{'vs bare':>9}")
    print(header)
    print("-" * len(header))
    for n in names:
        v = per_step[n]
        print(f"{n:<26}{med[n]:>13.2f}{min(v):>9.2f}{max(v):>9.2f}{med[n] / bare:>9.3f}{paired[n]:>8.3f}"
              f"{cmed[n]:>13.2f}{cmed[n] / cbare:>9.3f}")
    print()
    k10, k1 = "train(), log_interval=10", "train(), log_interval=1"
    ratio, cratio = med[k10] / bare, cmed[k10] / cbare
    verdict = "OK" if ratio <= args.target else "ABOVE TARGET"
    print(f"train()/bare, log_interval=10: wall {ratio:.3f} ({med[k10] - bare:+.2f} ms/step), "
          f"cpu {cratio:.3f} ({cmed[k10] - cbare:+.2f} ms/step)  target <= {args.target}: {verdict}")
    print(f"logging every iteration vs every 10: wall {med[k1] - med[k10]:+.2f} ms/step, "
          f"cpu {cmed[k1] - cmed[k10]:+.2f} ms/step (train()/bare at log_interval=1: wall {med[k1] / bare:.3f}, "
          f"cpu {cmed[k1] / cbare:.3f})")
    kl = "+ listener, interval=10"
    listener = statistics.median(a / b for a, b in zip(per_step[kl], per_step[k10], strict=True))
    call = listener_call_seconds()
    print(f"one no-op listener call per step: {call * 1e6:.2f} us of cpu = {call * 1e3 / cmed[k10] * 100:.4f} % of "
          f"train()'s {cmed[k10]:.2f} ms cpu step (ratio {1 + call * 1e3 / cmed[k10]:.5f}); paired wall ratio "
          f"{listener:.3f} ({med[kl] - med[k10]:+.3f} ms/step wall, {cmed[kl] - cmed[k10]:+.3f} ms/step cpu: noise)")
    ks = "+ snapshots, interval=10"
    snap = statistics.median(a / b for a, b in zip(per_step[ks], per_step[k10], strict=True))
    # A snapshot falls in some blocks only: the medians hide it, the totals over every block pay it once each.
    total, ctotal = sum(per_step[ks]) / sum(per_step[k10]), sum(cpu_step[ks]) / sum(cpu_step[k10])
    memory = snap_ckpt.memory
    memory.wait()
    print(f"memory snapshots at the default interval: {memory.taken} taken in {args.reps * args.steps + args.warmup} "
          f"steps, each blocking the loop {memory.blocked * 1e3:.2f} ms and written in the background in "
          f"{memory.write_seconds * 1e3:.1f} ms; over all blocks, wall {total:.3f} and cpu {ctotal:.3f} of train()'s "
          f"(paired median wall {snap:.3f}, cpu {cmed[ks] / cmed[k10]:.3f})  target <= 1.02")
    import shutil

    shutil.rmtree(snap_dir, ignore_errors=True)
    print("paired = median over repetitions of wall(variant)/wall(bare) in the same repetition; cpu = this "
          "process's CPU time (robust to other processes on a shared machine)")
    train_it.close()
    metrics.close()
    return 1 if args.check and ratio > args.target else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown of megatron/gloo state
