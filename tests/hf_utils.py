"""Shared helpers for the Hugging Face interop tests: tiny random Llama, Qwen3, Qwen3-MoE and Mixtral
models made with `transformers` (never downloaded)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from tests.trainer_utils import env_for, kubetron_cmd

REPO = Path(__file__).resolve().parent.parent
SFT_LINES = [{"input": f"Q{i}: what is {i} plus {i}? ", "output": f"{2 * i}"} for i in range(40)]

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


def _norms_away_from_one(model):
    """Every norm weight away from 1 (a dropped or swapped norm shows in the logits)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))


def make_tiny_qwen3_moe(out: Path, *, norm_topk_prob: bool = False, mlp_only_layers=(1,), seed: int = 5) -> Path:
    """Qwen3-MoE: 3 layers, layer 1 a dense MLP (96) and the others 8 experts (32) with top-2 routing; Qwen3's
    attention (head_dim 24, GQA, q/k norms). norm_topk_prob False (transformers' default): the chosen router
    probabilities are not renormalised. Saved as safetensors (one tensor per expert projection)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
                         mlp_only_layers=list(mlp_only_layers), router_aux_loss_coef=0.02, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, initializer_range=0.1)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    _norms_away_from_one(model)
    model.save_pretrained(out)
    return out


def make_tiny_mixtral(out: Path, *, sliding_window: int | None = 8, seed: int = 6) -> Path:
    """Mixtral: 2 layers of 8 experts (48) with top-2 routing (renormalised, as Mixtral always does), GQA,
    an 8-token sliding window, norm weights away from 1. Saved as safetensors (w1/w2/w3 per expert)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=48, num_local_experts=8,
                        num_experts_per_tok=2, router_aux_loss_coef=0.03, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=256, sliding_window=sliding_window,
                        rms_norm_eps=1e-5, initializer_range=0.1)
    model = MixtralForCausalLM(cfg).float().eval()
    _norms_away_from_one(model)
    model.save_pretrained(out)
    return out


def hf_logits(hf_dir: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def config_for(model_keys: dict, *overrides: str, world_size: int = 1):
    """A finalized run config with this `model:` section."""
    from kubetron.config import ConfigContainer
    from kubetron.contract.config import apply_overrides

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


def run_cli(args, tmp: Path, timeout=400) -> subprocess.CompletedProcess:
    """`kubetron ARGS` in a subprocess, as a user runs it."""
    return subprocess.run(kubetron_cmd(*args), env=env_for(tmp), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def imported_model_keys(ckpt: Path) -> dict:
    import yaml

    return yaml.safe_load((ckpt / "iter_0000000" / "run_config.yaml").read_text())["model"]


def imported_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The canonical tensors import-hf wrote (sharded format), read by export-hf's own reader."""
    from kubetron.hf.io import read_checkpoint

    return read_checkpoint(str(ckpt))[1]


def finetune_args(tmp: Path, data: Path, pretrained: Path, keys: dict, iters: int) -> list[str]:
    model = [f"model.{k}={json.dumps(v)}" for k, v in keys.items() if k not in ("seq_length",)]
    return ["finetune", *model, "model.seq_length=64", f"train.train_iters={iters}", "train.micro_batch_size=2",
            "train.global_batch_size=4", "optimizer.lr=1e-3", "scheduler.lr_decay_style=constant",
            "validation.eval_interval=null", f"finetuning.data_path={data}", "finetuning.packing=true",
            f"checkpoint.pretrained_checkpoint={pretrained}", f"checkpoint.save={tmp / 'run'}",
            f"checkpoint.save_interval={iters}", "logger.log_interval=1", "train.exit_signal_handler=false"]


def import_finetune_export(tmp: Path, hf: Path, iters: int) -> str:
    """import-hf HF -> finetune `iters` packed SFT iterations -> export-hf to tmp/out, the commands in this process
    (tests/inprocess.run_command); import-hf's console."""
    from tests.inprocess import run_command

    imported = run_command(["import-hf", str(hf), str(tmp / "ckpt")], tmp)
    assert imported.returncode == 0, imported.stderr
    data = tmp / "sft.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in SFT_LINES))
    p = run_command(finetune_args(tmp, data, tmp / "ckpt", imported_model_keys(tmp / "ckpt"), iters), tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_command(["export-hf", str(tmp / "run"), str(tmp / "out")], tmp)
    assert p.returncode == 0, p.stderr
    return imported.stdout
