"""Fine-tuning throughput with packing vs padding: answer-bearing tokens per second.

    .venv/bin/python bench/sft_packing.py [--steps 20] [--seq 256] [--threads 1]

The same JSONL (variable-length prompt/answer pairs, byte tokenizer), the same model and optimizer,
forward + backward + AdamW step per micro-batch of `--mbs` sequences, in the trainer's own pieces
(kubetron.data.finetuning, gpt_step.document_mask / masked_token_loss, training.model). Reported per
mode: real tokens (non-padding positions) per second and loss-bearing tokens per second; the two
modes run in alternating blocks so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_jsonl(path: Path, n: int, seed: int = 0):
    rng = random.Random(seed)
    words = "the a model data token answer question packing sequence train loss fine tune".split()
    with open(path, "w") as f:
        for _ in range(n):
            q = " ".join(rng.choices(words, k=rng.randint(3, 25)))
            a = " ".join(rng.choices(words, k=rng.randint(2, 20)))
            f.write(json.dumps({"input": q + "? ", "output": a}) + "\n")


def run(ds, model, opt, steps: int, mbs: int, start: int) -> tuple[float, int, int]:
    from kubetron.training.gpt_step import document_mask, masked_token_loss

    real = loss_tokens = 0
    t0 = time.perf_counter()
    for step in range(steps):
        samples = [ds[start + step * mbs + i] for i in range(mbs)]
        b = {k: torch.from_numpy(__import__("numpy").stack([s[k] for s in samples])) for k in samples[0]}
        mask = document_mask(b["segment_ids"]) if "segment_ids" in b else None
        out = model(b["tokens"], b["position_ids"], mask, labels=b["labels"])
        loss, n, _ = masked_token_loss(b["loss_mask"], out)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        real += int((b["segment_ids"] > 0).sum()) if "segment_ids" in b else int((b["labels"] != ds.pad).sum())
        loss_tokens += int(n)
    return time.perf_counter() - t0, real, loss_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kubetron.compat import megatron_core

    megatron_core.install()  # as `kubetron train` does, before anything imports megatron-core
    from kubetron.data.finetuning import FinetuningDataset
    from kubetron.data.tokenizer import ByteTokenizer
    from kubetron.training.model import build_model

    from tests.hf_utils import config_for
    from tests.inprocess import ensure_world_of_one

    ensure_world_of_one()
    cfg = config_for({"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": args.seq,
                      "normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False})
    model = build_model(cfg, torch.device("cpu"))[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "sft.jsonl"
        make_jsonl(path, 4000)
        modes = {m: FinetuningDataset(str(path), ByteTokenizer(), args.seq, packing=(m == "packing"), seed=0)
                 for m in ("padding", "packing")}
    totals = {m: [0.0, 0, 0] for m in modes}
    for rep in range(args.reps):
        for m, ds in modes.items():
            dt, real, lt = run(ds, model, opt, args.steps, args.mbs, rep * args.steps * args.mbs)
            totals[m] = [totals[m][0] + dt, totals[m][1] + real, totals[m][2] + lt]
    for m, (dt, real, lt) in totals.items():
        ds = modes[m]
        fill = ds.num_tokens / (len(ds) * args.seq)
        print(f"{m:8s}: {real / dt:8.0f} real tokens/s, {lt / dt:8.0f} loss tokens/s, "
              f"{dt / (args.reps * args.steps) * 1e3:6.1f} ms/step, fill {fill:.0%}")
    speedup = (totals["packing"][1] / totals["packing"][0]) / (totals["padding"][1] / totals["padding"][0])
    print(f"packing / padding real tokens/s: {speedup:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
