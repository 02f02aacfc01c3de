"""Fine-tuning data preparation: chats per second against transformers, and the cache hit.

    .venv/bin/python bench/sft_data.py [--chats 20250] [--template llama3|qwen3|mistral] [--seq 4096] [--reps 2]

One JSONL of chats (1-3 turns, a system prompt in a third of them), one tokenizer built like the real one and
saved by transformers' save_pretrained (tests/chat_tokenizers.py: Llama 3's with the Llama 3.2 template by
default). In the same run:

* transformers: read the file, ``apply_chat_template(messages, tokenize=True)`` per chat, as a loop over the rows
  does (ids only; no mask, no packing);
* kubetron build: ``FinetuningDataset`` with a cache directory and nothing in it - read, render, tokenize (with the
  assistant mask), pack, store;
* kubetron cache hit: the same again, which loads what the build stored.

Goals (issue 32): build >= 1.0x transformers' chats/s, cache hit >= 10x faster than the build. The ids of the
first chats are checked against transformers' before any figure is printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.chat_tokenizers
sys.path.insert(0, str(ROOT / "trainer"))

from tests.chat_tokenizers import BUILDERS, CORPUS  # noqa: E402


def make_chats(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = " ".join(CORPUS).split()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(lo, hi)))

    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(5, 20)}] if rng.random() < 1 / 3 else []
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": text(5, 60)}, {"role": "assistant", "content": text(5, 150)}]
        rows.append({"messages": messages})
    return rows


def transformers_loop(tok_dir: Path, data: Path) -> tuple[float, list[list[int]]]:
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    out = []
    with open(data) as f:
        for line in f:
            out.append(tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=False))
    return time.perf_counter() - t0, out


def kubetron_build(tok_dir: Path, data: Path, cache: Path, seq: int):
    from kubetron.data.finetuning import FinetuningDataset
    from kubetron.data.sft.cache import CachePlace
    from kubetron.data.tokenizer import tokenizer_from_assets

    t0 = time.perf_counter()
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(tok_dir))
    place = CachePlace(str(cache), True, str(cache.parent / "store"))  # the job's key in a store beside the cache
    ds = FinetuningDataset(str(data), tok, seq, packing=True, seed=0, cache_at=place)
    return time.perf_counter() - t0, ds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=20250)
    ap.add_argument("--template", choices=sorted(BUILDERS), default="llama3")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=2, help="alternating repetitions; the best time of each is shown")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok_dir = BUILDERS[args.template](root / "tok")
        data = root / "chats.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in make_chats(args.chats)))
        hf, build, hit = [], [], []
        for rep in range(args.reps):  # alternating, so a busier minute hits both
            hf_s, hf_ids = transformers_loop(tok_dir, data)
            build_s, ds = kubetron_build(tok_dir, data, root / f"cache{rep}", args.seq)
            hit_s, again = kubetron_build(tok_dir, data, root / f"cache{rep}", args.seq)
            hf.append(hf_s), build.append(build_s), hit.append(hit_s)
            print(f"  rep {rep}: transformers {hf_s:.2f} s, kubetron build {build_s:.2f} s ({hf_s / build_s:.2f}x), "
                  f"cache hit {hit_s:.2f} s", flush=True)
        for i in range(min(200, args.chats)):
            lo, hi = ds.offsets[i], ds.offsets[i + 1]
            assert ds.tokens[lo:hi].tolist() == hf_ids[i][:args.seq + 1], f"chat {i}: ids differ from transformers"
        assert len(again) == len(ds)
        n, hf_s, build_s, hit_s = args.chats, min(hf), min(build), min(hit)
        size = data.stat().st_size / 1e6
        print(f"{n} chats ({int(ds.offsets[-1])} tokens, template {args.template}, {size:.1f} MB), best of {args.reps}")
        print(f"  transformers apply_chat_template loop: {hf_s:7.2f} s  {n / hf_s:8.0f} chats/s")
        print(f"  kubetron build (mask, pack, store):    {build_s:7.2f} s  {n / build_s:8.0f} chats/s  "
              f"{hf_s / build_s:.2f}x transformers (goal >= 1.0)")
        print(f"  kubetron cache hit:                    {hit_s:7.2f} s  {build_s / hit_s:8.1f}x faster than the "
              "build (goal >= 10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
