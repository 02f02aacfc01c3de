"""Greedy generation with `transformers` from an HF model directory, with that model's own tokenizer.

    python examples/hf-sft/generate.py HF_DIR "prompt"
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(hf_dir: str, prompt: str) -> None:
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    print(f"{prompt!r} -> {tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
