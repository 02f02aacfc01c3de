"""The multi-rank half of bench/checkpoint.py (`--ranks N` runs this under torchrun; CPU, gloo).

Every rank builds the same GPT and AdamW state as `kubetron train` does and saves it through the real
`CheckpointManager` (the default `sharded` format; `kubetron` for comparison). Rank 0 prints:
  * bytes each rank wrote, as a share of the total (target ~1/world each)
  * rank 0's host memory for a save: RSS growth over the first save (the manager's host buffers, which
    later saves reuse), sampled every 2 ms, vs the total state size (target <= 1/world + 10 %); also
    with the distributed optimizer (ZeRO-1), whose ranks write the state fragments they own
  * async save: how long the loop is blocked vs a sync save (target <= 0.1); the baseline in the same run,
    the snapshot's copies by ctypes.memmove instead of kubetron.checkpoint._hostcopy; one bare copy of each as the floor
  * S3 (SeaweedFS, when KUBETRON_BENCH_S3=1 and AWS_* are set): per rank, a sync sharded save vs boto3
    `upload_file` of the same number of bytes, all ranks at once (target >= 0.8)
  * load: CheckpointManager.load() of the newest checkpoint, from the directory and from S3
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "trainer"))
from kubetron.checkpoint import hostcopy  # noqa: E402

MB = 1e6


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest RSS seen (every 2 ms) while the block runs, minus RSS at its start."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def build(a, store_url: str | None, fmt: str, async_save: bool, load: str | None = None, extra=()):
    from kubetron.compat import megatron_core

    megatron_core.install()  # as `kubetron train` does, before anything imports megatron-core
    from kubetron.checkpoint.manager import CheckpointManager, open_save_store
    from kubetron.config import ConfigContainer
    from kubetron.training.entry import initialize_distributed, set_seeds
    from kubetron.training.model import build_model
    from kubetron.training.optim import LRScheduler, build_optimizer
    from kubetron.training.state import GlobalState
    from megatron.core import parallel_state

    cfg = ConfigContainer.from_yaml(str(ROOT / "examples" / "tiny-gpt.yaml"), [
        f"model.num_layers={a.layers}", f"model.hidden_size={a.hidden}", "model.num_attention_heads=8",
        "model.seq_length=128", "train.train_iters=100", "validation.eval_interval=null",
        f"checkpoint.save={store_url or 'null'}", f"checkpoint.load={load or 'null'}",
        f"checkpoint.ckpt_format={fmt}", f"checkpoint.async_save={'true' if async_save else 'false'}",
        "checkpoint.most_recent_k=2", "logger.log_progress=false", "train.status_port=0", "dist.use_gpu=false", *extra])
    if not dist.is_initialized():
        initialize_distributed(cfg)
    cfg.finalize(world_size=dist.get_world_size())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    set_seeds(cfg)
    state = GlobalState(cfg=cfg)
    model = build_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(cfg, model)
    for p in model[0].parameters():  # one step, so Adam has its moments
        p.grad = torch.full_like(p, 1e-3)
    optimizer.finish_grad_sync()  # (the distributed optimizer steps its reduced gradient buffers)
    optimizer.step()
    scheduler = LRScheduler(optimizer, cfg)
    ckpt = CheckpointManager(cfg, open_save_store(cfg), model=model, optimizer=optimizer, scheduler=scheduler,
                             train_state=state.train_state, world_size=dist.get_world_size(), run_id=_same_id())
    return ckpt, model, optimizer


def _same_id() -> str:
    obj = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def state_bytes(model, optimizer) -> int:
    """Canonical size: parameters plus optimizer state tensors (one replica: DP ranks hold the same)."""
    n = sum(p.numel() * p.element_size() for p in model[0].parameters())
    return n + sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v))


def gather(x: float) -> list[float]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def blocked_vs_sync(ckpt, step, repeats: int) -> tuple[float, float]:
    """Median (over ranks: the slowest) of a sync save's time and of an async save's blocked time."""
    syncs, blocks = [], []
    for _ in range(repeats):
        syncs.append(max(gather(timed(lambda: ckpt.save(next(step), blocking=True)))))
        blocks.append(max(gather(timed(lambda: ckpt.save(next(step))))))
        ckpt.finalize(blocking=True)
    return statistics.median(syncs), statistics.median(blocks)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rank, rows = int(os.environ["RANK"]), []
    world = int(os.environ["WORLD_SIZE"])

    def row(*cols):
        rows.append(cols)
        if rank == 0:
            print("  " + " | ".join(cols), flush=True)

    # -- bytes per rank and rank 0's memory: the first save of a fresh manager, each format ------------
    step = iter(range(10, 10_000, 10))
    growth, save_s = {}, {}
    for fmt in ("sharded", "kubetron"):
        ckpt, model, optimizer = build(a, f"{a.dir}/{fmt}", fmt, async_save=False)
        total = state_bytes(model, optimizer)
        dist.barrier()
        with PeakRSS() as m:
            ckpt.save(next(step), blocking=True)
        growth[fmt] = (gather(m.growth), ckpt.buffers.nbytes)
        save_s[fmt] = statistics.median(max(gather(timed(lambda c=ckpt: c.save(next(step), blocking=True))))
                                        for _ in range(a.repeats))
        if fmt == "sharded":
            written = gather(ckpt.last_save_bytes)
            row("bytes written per rank (sharded)", ", ".join(f"{w / MB:.1f} MB" for w in written),
                f"total {sum(written) / MB:.1f} MB; state {total / MB:.1f} MB",
                "shares " + ", ".join(f"{w / sum(written):.3f}" for w in written) + f" (target ~{1 / world:.3f})")
        ckpt.close()
    # the distributed optimizer (ZeRO-1): each rank writes the fragments it owns, no gather
    ckpt, model, optimizer = build(a, f"{a.dir}/distopt", "sharded", async_save=False,
                                   extra=["ddp.use_distributed_optimizer=true"])
    dist.barrier()
    with PeakRSS() as m:
        ckpt.save(next(step), blocking=True)
    written = gather(ckpt.last_save_bytes)
    growth["sharded, distributed optimizer"] = (gather(m.growth), ckpt.buffers.nbytes, sum(written))
    row("bytes written per rank (sharded, distributed optimizer)", ", ".join(f"{w / MB:.1f} MB" for w in written),
        f"total {sum(written) / MB:.1f} MB (params, moments; fp32 mains of bf16 params only)",
        "shares " + ", ".join(f"{w / sum(written):.3f}" for w in written) + f" (target ~{1 / world:.3f})")
    ckpt.close()
    for fmt, (g, buffers, *size) in growth.items():
        size = size[0] if size else total
        row(f"rank 0 host memory for a save ({fmt})", f"{g[0] / MB:.1f} MB peak RSS growth",
            f"state {size / MB:.1f} MB; host buffers {buffers / MB:.1f} MB", f"ratio {g[0] / size:.3f}"
            + (" (gathers everything on rank 0)" if fmt == "kubetron" else f" (target <= {1 / world + 0.1:.2f})"))

    row("sync save to dir, sharded vs kubetron", f"{save_s['sharded']:.3f}s", f"kubetron {save_s['kubetron']:.3f}s",
        f"ratio {save_s['kubetron'] / save_s['sharded']:.2f} (kubetron time / sharded time)")

    # -- async: blocked time vs a sync save -------------------------------------------------------------
    ckpt, model, optimizer = build(a, f"{a.dir}/async", "sharded", async_save=True)
    ckpt.save(next(step), blocking=True)  # first touch of the host buffers is a one-time cost
    impl, built = hostcopy.copy_impl(), hostcopy._hostcopy
    sync_s, block_s = blocked_vs_sync(ckpt, step, a.repeats)
    row("async sharded save: loop blocked", f"{block_s:.3f}s", f"sync save {sync_s:.3f}s",
        f"ratio {block_s / sync_s:.3f} (target <= 0.1); snapshot copy: {impl}")
    if built is not None:  # the baseline, same run: the snapshot's copies by libc (the no-compiler fallback)
        hostcopy._hostcopy = None
        try:
            base_sync, base_block = blocked_vs_sync(ckpt, step, a.repeats)
        finally:
            hostcopy._hostcopy = built
        row("  (baseline) the same, copies by ctypes.memmove", f"{base_block:.3f}s", f"sync save {base_sync:.3f}s",
            f"ratio {base_block / base_sync:.3f}; blocked {base_block / block_s:.2f}x as long")
    ckpt.close()
    # The floor: one copy of a rank's share, by the snapshot's own copy and by libc. Touched buffers (an
    # untouched torch.empty reads the zero page: no memory traffic); a 256 MB sweep in between, so the
    # source is not in the caches (the snapshot copies state that the writer has long since evicted).
    src = torch.ones(ckpt.last_save_bytes // 4)
    dst, sweep = torch.zeros_like(src), torch.zeros(64 * 2**20)
    for name, fn in ((f"snapshot copy ({impl})", lambda: hostcopy.copy_host([(dst.data_ptr(), src.data_ptr(),
                                                                               src.numel() * 4)])),
                     ("libc memmove", lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * 4))):
        copies = []
        for _ in range(a.repeats):
            sweep.add_(1)
            copies.append(max(gather(timed(fn))))
        copy_s = statistics.median(copies)
        row(f"  (floor) one {name} of a rank's share", f"{copy_s:.3f}s", f"{ckpt.last_save_bytes / MB:.1f} MB",
            f"ratio {copy_s / sync_s:.3f} of the sync save")
    loader = build(a, None, "sharded", False, load=f"{a.dir}/async")[0]
    load_s = max(gather(timed(loader.load)))
    row("load <- dir (sharded)", f"{load_s:.2f}s", f"{total / MB / load_s:.0f} MB/s of state per rank")

    # -- S3: a rank's sharded save vs boto3 upload_file of the same bytes, all ranks at once -------------
    if os.environ.get("KUBETRON_BENCH_S3") == "1":
        import boto3

        bucket = os.environ["KUBETRON_BENCH_BUCKET"]
        url = f"s3://{bucket}/bench-{_same_id()}"
        ckpt, model, optimizer = build(a, url, "sharded", async_save=False)
        ckpt.save(next(step), blocking=True)
        blob = Path(a.dir) / f"blob-{rank}.bin"
        blob.write_bytes(os.urandom(ckpt.last_save_bytes))
        from botocore.config import Config

        client = boto3.client("s3", config=Config(s3={"addressing_style": "path"}))
        saves, uploads = [], []
        for i in range(a.repeats):
            uploads.append(timed(lambda i=i: client.upload_file(str(blob), bucket, f"boto3/{rank}-{i}.bin")))
            saves.append(timed(lambda: ckpt.save(next(step), blocking=True)))
        ckpt.close()
        save_s, up_s = gather(min(saves)), gather(min(uploads))
        row("S3 sharded save per rank", ", ".join(f"{s:.2f}s" for s in save_s),
            "boto3 upload_file " + ", ".join(f"{u:.2f}s" for u in up_s),
            "ratio " + ", ".join(f"{u / s:.2f}" for u, s in zip(up_s, save_s, strict=True)) + " (target >= 0.8)")
        ackpt = build(a, url, "sharded", async_save=True)[0]
        ackpt.save(next(step), blocking=True)  # host buffers allocated
        blocks = []
        for _ in range(a.repeats):
            blocks.append(max(gather(timed(lambda: ackpt.save(next(step))))))
            ackpt.finalize(blocking=True)
        ackpt.close()
        block_s = statistics.median(blocks)
        row("async sharded save to S3: loop blocked", f"{block_s:.3f}s", f"sync S3 save {max(save_s):.2f}s",
            f"ratio {block_s / max(save_s):.3f} (target <= 0.1)")
        loader = build(a, None, "sharded", False, load=url)[0]
        load_s = max(gather(timed(loader.load)))
        row("load <- S3 (sharded)", f"{load_s:.2f}s", f"{total / MB / load_s:.0f} MB/s of state per rank")
    if rank == 0:
        w = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(4)]
        print(f"\n{world} ranks, {a.layers} layers, hidden {a.hidden}, state {total / MB:.1f} MB "
              f"(fp32 params + Adam moments)")
        for r in rows:
            print(" | ".join(c.ljust(w[i]) for i, c in enumerate(r)))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
