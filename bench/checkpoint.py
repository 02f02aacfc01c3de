"""Checkpoint save/load throughput through kubetron.storage, against raw baselines measured in the same run.

    .venv/bin/python bench/checkpoint.py [--size-mb 1024] [--dir DIR] [--s3 auto|off] [--device cpu|cuda]
    .venv/bin/python bench/checkpoint.py --ranks 2 [--layers 4 --hidden 512] [--s3 auto|off]

`--ranks N`: the sharded checkpoints of a real model under torchrun (CPU, gloo): bytes per rank, rank 0's
memory, async blocked time, S3 save per rank vs boto3, load time (bench/checkpoint_ranks.py says more).

Payload: `torch.save` of a dict of fp32 tensors shaped like a model plus Adam state (1/4 params, 1/4
master weights... in practice: 4 equal groups: params, fp32 master, exp_avg, exp_avg_sq).
Rows (best of --repeats):
  * sync save to DIR through Store (txn + torch.save + fsync + rename + marker) vs the directory's raw
    write bandwidth (dd-like: one file, 64 MiB writes, fsync) of the same number of bytes -> ratio >= 0.8
  * async save: how long the caller blocks (snapshot into reused host buffers + schedule) vs a sync
    save -> ratio <= 0.1; plus when the background save was durable
  * S3 save (SeaweedFS started here unless --s3 off) through Store vs boto3 `upload_file` of the same
    bytes to the same server -> ratio >= 0.8
  * load MB/s: torch.load(store.open_read(...), weights_only=True) from DIR and from S3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.s3server
sys.path.insert(0, str(ROOT / "trainer"))

from kubetron.storage import AsyncSaver, open_store  # noqa: E402
from kubetron.storage.s3 import S3Options  # noqa: E402

MB = 1e6


def make_state(size_mb: int, device: str) -> dict:
    """Four equal groups (params, master params, exp_avg, exp_avg_sq) of 8 tensors each."""
    per = int(size_mb * MB / 4 / 8 / 4)  # fp32 elements per tensor
    g = torch.Generator(device="cpu").manual_seed(0)

    def t():
        return torch.rand(per, generator=g).to(device)

    return {
        "model": {f"layer{i}.weight": t() for i in range(8)},
        "optimizer": {
            "master": {i: t() for i in range(8)},
            "exp_avg": {i: t() for i in range(8)},
            "exp_avg_sq": {i: t() for i in range(8)},
            "step": 100,
        },
        "iteration": 100,
    }


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    return 0


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)


def alloc_like(obj, pin: bool):
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=pin)
    if isinstance(obj, dict):
        return {k: alloc_like(v, pin) for k, v in obj.items()}
    return obj


def copy_into(dst, src):
    if isinstance(src, torch.Tensor):
        dst.copy_(src, non_blocking=True)
        return dst
    if isinstance(src, dict):
        return {k: copy_into(dst[k], v) for k, v in src.items()}
    return src


def raw_write(path: Path, buf: memoryview) -> float:
    """dd-like: write `buf` to a new file in 64 MiB writes, fsync, close. Seconds."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(buf), 64 << 20):
            os.write(fd, buf[off : off + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sync_save(store, name: str, state) -> float:
    t0 = time.perf_counter()
    txn = store.begin_dir(name)
    with txn.open_write("state.pt") as f:
        torch.save(state, f)
    txn.commit(b'{"bench": true}')
    return time.perf_counter() - t0


def timed_load(store, key: str) -> float:
    t0 = time.perf_counter()
    with store.open_read(key) as f:
        torch.load(f, weights_only=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="directory to save into (default: a temp dir under /tmp)")
    ap.add_argument("--s3", default="auto", help="auto: start SeaweedFS here; off: skip S3 rows")
    ap.add_argument("--device", default="cpu", help="where the training state lives (cpu or cuda)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--part-mb", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--no-payload-signing", action="store_true", help="S3Options(payload_signing=False)")
    ap.add_argument("--ranks", type=int, default=0, help="multi-rank mode: this many ranks under torchrun")
    ap.add_argument("--layers", type=int, default=4, help="multi-rank mode: GPT layers")
    ap.add_argument("--hidden", type=int, default=512, help="multi-rank mode: GPT hidden size")
    a = ap.parse_args()

    work = Path(a.dir or tempfile.mkdtemp(prefix="kubetron-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.ranks:
        return multirank(a, work)
    t0 = time.perf_counter()
    state = make_state(a.size_mb, a.device)
    size = nbytes(state)
    print(
        f"# {size / MB:.0f} MB of fp32 state on {a.device} ({sum(1 for _ in tensors(state))} tensors, "
        f"built in {time.perf_counter() - t0:.1f}s); dir {work}; torch {torch.__version__}; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    rows: list[tuple[str, str, str, str]] = []

    def row(what, value, baseline="", ratio=""):
        rows.append((what, value, baseline, ratio))
        print(f"  {what}: {value} {baseline} {ratio}", flush=True)

    # -- filesystem: sync save vs raw write bandwidth -------------------------------------------------
    store = open_store(str(work / "store"))
    raw_buf = memoryview(bytearray(os.urandom(1 << 20)) * (size >> 20))  # same bytes count, not zeros
    raws, saves = [], []
    for i in range(a.repeats):
        raws.append(raw_write(work / "raw.bin", raw_buf))
        saves.append(sync_save(store, f"iter_{i:07d}", state))
    del raw_buf
    raw_s, save_s = min(raws), min(saves)
    saved = store.list("iter_0000000")
    ckpt_bytes = sum((work / "store" / k).stat().st_size for k in saved)
    row(
        "sync save -> dir (Store)",
        f"{save_s:.2f}s = {ckpt_bytes / MB / save_s:.0f} MB/s",
        f"raw write+fsync {size / MB / raw_s:.0f} MB/s",
        f"ratio {ckpt_bytes / save_s / (size / raw_s):.2f} (target >= 0.8)",
    )

    # -- async: what the caller waits for --------------------------------------------------------------
    pin = a.device != "cpu" and torch.cuda.is_available()
    staging = alloc_like(state, pin)  # reused across saves, like a real async checkpointer
    copy_into(staging, state)  # first touch of the buffers is a one-time cost
    saver = AsyncSaver()
    blocks, totals = [], []
    for i in range(a.repeats):
        t0 = time.perf_counter()
        snap = copy_into(staging, state)
        if a.device != "cpu":
            torch.cuda.synchronize()
        done = {}
        saver.schedule(
            lambda snap=snap, i=i: sync_save(store, f"iter_{100 + i:07d}", snap),
            lambda done=done: done.setdefault("t", time.perf_counter()),
        )
        blocks.append(time.perf_counter() - t0)
        saver.maybe_finalize(blocking=True)
        totals.append(done["t"] - t0)
    saver.close()
    t0 = time.perf_counter()
    fresh = [t.to("cpu", copy=True) for t in tensors(state)]  # a fresh-allocation snapshot, for reference
    clone_s = time.perf_counter() - t0
    del fresh
    row(
        "async save: caller blocked",
        f"{min(blocks):.3f}s (snapshot into reused host buffers)",
        f"sync save {save_s:.2f}s; async durable after {min(totals):.2f}s",
        f"ratio {min(blocks) / save_s:.3f} (target <= 0.1)",
    )
    row(
        "  (for reference) snapshot by clone()",
        f"{clone_s:.3f}s (fresh allocation: page faults on every save)",
    )

    # -- load from the directory -----------------------------------------------------------------------
    cold = drop_caches()
    load_s = timed_load(store, "iter_0000000/state.pt")
    row(
        "load <- dir",
        f"{ckpt_bytes / MB / load_s:.0f} MB/s",
        "page cache dropped" if cold else "page cache warm",
    )
    shutil.rmtree(work / "store", ignore_errors=True)

    # -- S3 ------------------------------------------------------------------------------------------------
    if a.s3 != "off":
        from tests.s3server import start_s3_server

        with start_s3_server(work / "s3server") as srv:
            opts = S3Options(part_size=a.part_mb << 20, concurrency=a.concurrency)
            if a.no_payload_signing:
                opts.payload_signing = False
            s3 = open_store(
                f"s3://{srv.bucket}/bench-{uuid.uuid4().hex[:6]}",
                endpoint_url=srv.endpoint,
                access_key=srv.access_key,
                secret_key=srv.secret_key,
                s3_options=opts,
            )
            client = srv.client()
            blob_path = work / "state.pt"
            torch.save(state, blob_path)  # the same bytes, for upload_file
            blob = blob_path.read_bytes()
            up_s3, up_b3, up_raw = [], [], []
            for i in range(a.repeats):  # interleaved, so both see the same machine load
                t0 = time.perf_counter()
                client.upload_file(str(blob_path), srv.bucket, f"boto3/state-{i}.pt")
                up_b3.append(time.perf_counter() - t0)
                up_s3.append(sync_save(s3, f"iter_{i:07d}", state))
                t0 = time.perf_counter()
                s3.write_bytes(f"raw/state-{i}.pt", blob)
                up_raw.append(time.perf_counter() - t0)
            del blob
            s3_s, b3_s, raw_s3 = min(up_s3), min(up_b3), min(up_raw)
            row(
                "sync save -> S3 (Store, streaming)",
                f"{s3_s:.2f}s = {ckpt_bytes / MB / s3_s:.0f} MB/s",
                f"boto3 upload_file {ckpt_bytes / MB / b3_s:.0f} MB/s",
                f"ratio {b3_s / s3_s:.2f} (target >= 0.8)",
            )
            row(
                "  same bytes, no torch.save (Store)",
                f"{raw_s3:.2f}s = {ckpt_bytes / MB / raw_s3:.0f} MB/s",
                f"boto3 upload_file {ckpt_bytes / MB / b3_s:.0f} MB/s",
                f"ratio {b3_s / raw_s3:.2f}",
            )
            loads = [timed_load(s3, "iter_0000000/state.pt") for _ in range(a.repeats)]
            t0 = time.perf_counter()
            client.download_file(srv.bucket, "boto3/state-0.pt", str(work / "dl.pt"))
            dl_s = time.perf_counter() - t0
            row(
                "load <- S3 (ranged parallel GETs)",
                f"{ckpt_bytes / MB / min(loads):.0f} MB/s",
                f"boto3 download_file {ckpt_bytes / MB / dl_s:.0f} MB/s",
            )
            s3.close()
            with contextlib.suppress(OSError):
                blob_path.unlink()
                (work / "dl.pt").unlink()
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)

    w = [max(len(r[i]) for r in rows) for i in range(4)]
    print("\n" + " | ".join(h.ljust(w[i]) for i, h in enumerate(("what", "result", "baseline", "ratio"))))
    print("-+-".join("-" * x for x in w))
    for r in rows:
        print(" | ".join(c.ljust(w[i]) for i, c in enumerate(r)))
    return 0


def multirank(a, work: Path) -> int:
    """torchrun bench/checkpoint_ranks.py, with a SeaweedFS server for the S3 rows unless --s3 off."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.ranks), "--master-port",
           str(port), str(ROOT / "bench" / "checkpoint_ranks.py"), "--dir", str(work), "--layers", str(a.layers),
           "--hidden", str(a.hidden), "--repeats", str(a.repeats)]
    # A fixed mmap threshold: large buffers are mapped on allocation and unmapped on free (glibc's
    # sliding threshold would recycle freed heap memory), so RSS growth shows what a save allocates.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    try:
        if a.s3 == "off":
            return subprocess.run(cmd, env=env, check=False).returncode
        from tests.s3server import start_s3_server

        with start_s3_server(work / "s3server") as srv:
            env.update(srv.env(), KUBETRON_BENCH_S3="1", KUBETRON_BENCH_BUCKET=srv.bucket)
            return subprocess.run(cmd, env=env, check=False).returncode
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
