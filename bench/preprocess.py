"""Tokens/s of `kubetron preprocess` against the tokenizer's own `encode_batch` over the same input.

    .venv/bin/python bench/preprocess.py [--mb 20] [--workers 1 2] [--tokenizer hf|sp] [--vocab 8000]

The input is a JSONL corpus of about `--mb` MiB made on the spot (no download): documents of
sentences drawn from the text of the installed Python packages' docstrings and comments, 200 to
4000 characters each. `--tokenizer hf` trains a byte-level BPE `tokenizer.json` of `--vocab` tokens
on it with `tokenizers`; `sp` uses the SentencePiece model that `mistral-common` ships.

Measured, each over the same documents:

  * baseline:   the tokenizer's own batch encoder on the documents already in memory
                (`tokenizers.Tokenizer.encode_batch`, which runs on all cores by itself; or
                `SentencePieceProcessor.encode(list, num_threads=cores)`): no file reading, no JSON,
                no output. Its tokens/s is the ceiling of tokenization alone.
  * kubetron:   the `kubetron preprocess` command (`--workers N`) end to end: read + parse the
                JSONL, tokenize, append eod, write the .bin/.idx. tokens/s from the run's own clock
                (which starts after megatron-core's import), and the command's wall time.

Printed: both rates and the ratio kubetron / baseline per worker count.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "trainer"))


def make_corpus(path: Path, mib: float, seed: int = 0) -> list[str]:
    """Documents of real-looking English sentences (docstrings and comments of installed packages)."""
    import numpy
    import torch

    sentences = []
    for pkg in (torch, numpy):
        for f in sorted(Path(pkg.__file__).parent.rglob("*.py"))[:400]:
            text = f.read_text(errors="ignore")
            sentences += [s.strip() for s in re.findall(r"[A-Z][a-z][^.\n]{20,200}\.", text)]
    rng = random.Random(seed)
    docs, size = [], 0
    while size < mib * (1 << 20):
        n = rng.randint(200, 4000)
        doc = ""
        while len(doc) < n:
            doc += rng.choice(sentences) + " "
        docs.append(doc.strip())
        size += len(docs[-1])
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def baseline(kind: str, model: str, docs: list[str]) -> tuple[int, float]:
    if kind == "hf":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(model)
        t0 = time.perf_counter()
        n = sum(len(e.ids) for e in tok.encode_batch(docs))
    else:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=model)
        t0 = time.perf_counter()
        n = sum(len(ids) for ids in sp.encode(docs, num_threads=os.cpu_count()))
    return n, time.perf_counter() - t0


def kubetron(kind: str, model: str, src: Path, out: Path, workers: int) -> tuple[dict, float]:
    tok_type = "HuggingFaceTokenizer" if kind == "hf" else "SentencePieceTokenizer"
    cmd = [str(Path(sys.executable).parent / "kubetron"), "preprocess", "--input", str(src), "--output-prefix",
           str(out), "--tokenizer-type", tok_type, "--tokenizer-model", model, "--workers", str(workers)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout), time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=20, help="corpus size in MiB (default 20)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run (default 1 2)")
    ap.add_argument("--tokenizer", choices=("hf", "sp"), default="hf")
    ap.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary for --tokenizer hf")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        docs = make_corpus(d / "corpus.jsonl", args.mb)
        if args.tokenizer == "hf":
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            tok.train_from_iterator(docs[:2000], trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=[
                "<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
            model = str(d / "tokenizer.json")
            tok.save(model)
        else:
            import importlib.resources

            model = str(importlib.resources.files("mistral_common") / "data" / "tokenizer.model.v1")
        n, secs = baseline(args.tokenizer, model, docs)
        base = n / secs
        print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / (1 << 20):.1f} MiB, {os.cpu_count()} cores; "
              f"tokenizer {args.tokenizer}")
        print(f"baseline encode_batch: {n:,} tokens in {secs:.2f}s = {base:,.0f} tokens/s")
        for w in args.workers:
            result, wall = kubetron(args.tokenizer, model, d / "corpus.jsonl", d / f"out{w}", w)
            rate = (result["tokens"] - result["documents"]) / result["seconds"]  # eod tokens not counted
            print(f"kubetron preprocess --workers {w}: {result['tokens'] - result['documents']:,} tokens (+ eod) in "
                  f"{result['seconds']:.2f}s = {rate:,.0f} tokens/s (command wall {wall:.1f}s); "
                  f"ratio to encode_batch {rate / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
