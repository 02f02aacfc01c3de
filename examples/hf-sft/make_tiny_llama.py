"""Write a tiny random Llama with its own tokenizer (Hugging Face format) to OUT: no download.

    python examples/hf-sft/make_tiny_llama.py OUT

OUT gets what a real HF model directory holds: config.json + model.safetensors, and tokenizer.json +
tokenizer_config.json, a byte-level BPE trained here on sft.jsonl (at most 512 ids, eos <|endoftext|>,
pad <pad>), so kubetron (`tokenizer_type: HuggingFaceTokenizer`, `tokenizer_model: OUT`) and
`transformers` agree on what every id means. GQA (8 heads, 2 groups), untied output layer, Llama-3
rope scaling: the shape of a real Llama 3, scaled down.
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 512
SFT = Path(__file__).with_name("sft.jsonl")


def train_tokenizer(out: Path) -> Tokenizer:
    """A byte-level BPE (any text encodes) with merges learnt from the fine-tuning data."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rows = [json.loads(line) for line in SFT.read_text().splitlines() if line.strip()]
    tok.train_from_iterator([r["input"] + r["output"] for r in rows] * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<pad>"}))
    return tok


def main(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(Path(out))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                      bos_token_id=None, eos_token_id=tok.token_to_id("<|endoftext|>"),
                      pad_token_id=tok.token_to_id("<pad>"))
    LlamaForCausalLM(cfg).save_pretrained(out)
    print(f"wrote {out} (tokenizer: {tok.get_vocab_size()} ids)")


if __name__ == "__main__":
    main(sys.argv[1])
