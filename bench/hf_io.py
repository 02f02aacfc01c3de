"""Peak memory (RSS) of `kubetron import-hf` and `kubetron export-hf` against the size of the model.

    .venv/bin/python bench/hf_io.py [--hidden 1024 --layers 4 --vocab 32000] [--max-shard-size 100MB]
                                    [--baseline main]

A random Llama (untied, GQA, fp32) of the given shape is saved by transformers' `save_pretrained` (no
download), then each command runs in its own process: import-hf of that directory, then export-hf of the
import. The figure per command is the child's peak resident set (`wait4`'s ru_maxrss), next to the
peak of a process that only imports what the command imports (python, torch, megatron-core): the
difference is what the command holds for the model, reported as a multiple of the model's bytes.
`--baseline REF` runs the same two commands with the trainer of git revision REF (`git archive`, put
first on PYTHONPATH) in the same run, on the same model, so before and after are measured alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run in the child: import everything the commands use, reset the kernel's peak-RSS mark (clear_refs 5), run the
# command in-process, then report the resident set after the imports and the peak since.
CHILD = """
import json, sys
import torch, safetensors.torch, kubetron.compat.megatron_core, kubetron.hf.io
kubetron.compat.megatron_core.install()
import kubetron.checkpoint.format_sharded, kubetron.checkpoint.format_kubetron, kubetron.checkpoint.canonical
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS:")
from kubetron.cli import main
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "base": base, "peak": status("VmHWM:")}, f)
"""


def make_model(out: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random Llama saved as safetensors; returns its bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(out)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_measured(args: list[str], pythonpath: str | None, work: Path) -> tuple[int, int]:
    """(resident bytes after the imports, peak resident bytes while the command ran) of `kubetron ARGS`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    report = work / "report.json"
    p = subprocess.run([sys.executable, "-c", CHILD, str(report), *args], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"kubetron {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    got = json.loads(report.read_text())
    return got["base"], got["peak"]


def measure(label: str, hf: Path, work: Path, pythonpath: str | None, shard: str | None) -> list[tuple]:
    ckpt, out = work / f"{label}-ckpt", work / f"{label}-out"
    export = ["export-hf", str(ckpt), str(out)] + (["--max-shard-size", shard] if shard else [])
    return [("import-hf", *run_measured(["import-hf", str(hf), str(ckpt)], pythonpath, work)),
            ("export-hf", *run_measured(export, pythonpath, work))]


def baseline_tree(ref: str, work: Path) -> str:
    """The trainer package of git revision `ref`, unpacked under `work`; returns its import root."""
    dest = work / f"src-{ref.replace('/', '_')}"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "trainer"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return str(dest / "trainer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-shard-size", default="100MB", help="export-hf's (default: %(default)s)")
    ap.add_argument("--baseline", default=None, metavar="REF", help="also measure the trainer of git revision REF")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kubetron-hf-io-"))
    try:
        size = make_model(work / "hf", args.hidden, args.layers, args.vocab)
        print(f"model: Llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32: "
              f"{size / 1e6:,.0f} MB; export --max-shard-size {args.max_shard_size}\n")
        runs = [("this tree", None, args.max_shard_size)]
        if args.baseline:
            runs.insert(0, (args.baseline, baseline_tree(args.baseline, work), None))
        print(f"{'code':<12}{'command':<12}{'after imports MB':>18}{'peak MB':>10}{'held MB':>10}{'x model':>9}")
        for label, path, shard in runs:
            for name, base, peak in measure(label.replace("/", "_").replace(" ", "-"), work / "hf", work, path, shard):
                print(f"{label:<12}{name:<12}{base / 1e6:18,.0f}{peak / 1e6:10,.0f}{(peak - base) / 1e6:10,.0f}"
                      f"{(peak - base) / size:9.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
