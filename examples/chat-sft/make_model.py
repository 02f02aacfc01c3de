"""Write a tiny random chat model with its own tokenizer and chat template (Hugging Face format) to OUT: no download.

    python examples/chat-sft/make_model.py OUT

OUT gets what a chat model's directory holds: config.json + model.safetensors (a Llama of 4 layers, hidden 128),
tokenizer.json + tokenizer_config.json (a byte-level BPE trained here on chats.jsonl, with <|im_start|>/<|im_end|>
as special tokens, eos <|im_end|>) and chat_template.jinja: ChatML with tools in the system turn and Hermes-style
tool calls (<tool_call>{"name": ..., "arguments": ...}</tool_call>), the format Qwen2.5 and Hermes models use.
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 512
CHATS = Path(__file__).with_name("chats.jsonl")
TEMPLATE = Path(__file__).with_name("chat_template.jinja")
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")  # Qwen's pre-tokenizer split


def texts() -> list[str]:
    """Every string of the chats (messages, tool calls, tool specs): what the tokenizer learns its merges from."""
    out = []
    for line in CHATS.read_text().splitlines():
        row = json.loads(line)
        out += [json.dumps(row.get("tools", []))]
        for m in row["messages"]:
            out += [m.get("content") or "", json.dumps(m.get("tool_calls", []))]
    return out


def make_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts() * 4, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = TEMPLATE.read_text()
    hf.save_pretrained(out)
    return hf


def main(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(Path(out))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    print(f"wrote {out} (tokenizer: {len(tok)} ids, chat template with tools)")


if __name__ == "__main__":
    main(sys.argv[1])
