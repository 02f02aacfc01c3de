"""Greedy generation with `transformers` from an HF model directory, with that model's own tokenizer.

    python examples/hf-sft/generate.py HF_DIR "prompt"

No eos/pad ids are passed: `export-hf` writes the base model's (config.json, generation_config.json),
so generation stops at the end of the answer as it would for any consumer of the export.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(hf_dir: str, prompt: str) -> None:
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    print(f"{prompt!r} -> {tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
