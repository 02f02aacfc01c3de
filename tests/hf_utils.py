"""Shared helpers for the Hugging Face interop tests: tiny random Llama and Qwen3 models made with
`transformers` (never downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENS = torch.tensor([[5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 3, 77, 12, 0, 255, 31] * 3,
                       [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 110, 120, 130, 140, 150, 160] * 3])


def make_tiny_llama(out: Path, *, vocab: int = 512, tied: bool = False, seed: int = 0, argmax: int | None = None,
                    generation_config: dict | None = None, rope_theta: float = 500000.0) -> Path:
    """GQA (4 heads, 2 groups), untied, Llama-3 rope scaling that changes the frequencies at this size,
    norm weights away from 1 (so a swapped norm shows). Saved as safetensors. config.json: eos 256, pad 257.

    `argmax`: greedy decoding emits this token next whatever the input (every embedding shares one
    direction that dominates the residual stream; that token's output row points along it).
    `generation_config`: written as generation_config.json (else transformers' own from config.json)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=rope_theta, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=tied,
                      rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                      bos_token_id=None, eos_token_id=256, pad_token_id=257)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        if argmax is not None:
            u = torch.nn.functional.normalize(torch.randn(cfg.hidden_size), dim=0)
            model.model.embed_tokens.weight.add_(20 * u)
            model.model.norm.weight.fill_(1.0)
            model.lm_head.weight[argmax] = 2 * u
    model.save_pretrained(out)
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config))
    return out


def make_tiny_qwen3(out: Path, *, tied: bool, head_dim: int = 24, seed: int = 3) -> Path:
    """Qwen3: GQA (4 heads, 2 groups), head_dim 24 (4 * 24 != hidden 64), per-head q/k RMSNorm; every
    norm weight away from 1 (a dropped or swapped q/k norm shows). Saved as safetensors."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def hf_logits(hf_dir: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def config_for(model_keys: dict, *overrides: str, world_size: int = 1):
    """A finalized run config with this `model:` section."""
    from kubetron.config import ConfigContainer, apply_overrides

    data = {"model": dict(model_keys), "train": {"train_iters": 1}}
    if "vocab_size" in model_keys:  # a tokenizer as large as the model's vocabulary: no masked padding rows
        data["tokenizer"] = {"tokenizer_type": "null", "vocab_size": model_keys["vocab_size"]}
    data = apply_overrides(data, list(overrides))
    cfg = ConfigContainer.from_dict(data)
    return cfg.finalize(world_size=world_size, check_paths=False)


def kubetron_logits(model, tokens: torch.Tensor = TOKENS, attention_mask=None, position_ids=None) -> torch.Tensor:
    """Full-vocabulary logits of a kubetron model chunk (gathered over tensor-parallel ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        out = model(tokens, position_ids, attention_mask)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out
