"""Greedy generation with `transformers` from an exported model (byte-level ids).

    python examples/hf-sft/generate.py HF_DIR "prompt"

No eos/pad ids are passed: `export-hf` writes the base model's (config.json, generation_config.json),
so generation stops at the end of the answer as it would for any consumer of the export.
"""

import sys

import torch
from transformers import AutoModelForCausalLM


def main(hf_dir: str, prompt: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.tensor([list(prompt.encode())])
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = bytes(i for i in out[0, ids.shape[1]:].tolist() if i < 256).decode(errors="replace")
    print(f"{prompt!r} -> {answer!r}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
