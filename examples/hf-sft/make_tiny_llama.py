"""Write a tiny random Llama (Hugging Face format, safetensors) to OUT: no download.

    python examples/hf-sft/make_tiny_llama.py OUT

Its vocabulary (512) covers the byte tokenizer's ids (0-255 bytes, 256 eod, 257 pad), so kubetron's
`tokenizer_type: byte` and `transformers` agree on what every id means. GQA (8 heads, 2 groups),
untied output layer, Llama-3 rope scaling: the shape of a real Llama 3, scaled down.
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main(out: str) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                      bos_token_id=None, eos_token_id=256, pad_token_id=257)
    LlamaForCausalLM(cfg).save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
