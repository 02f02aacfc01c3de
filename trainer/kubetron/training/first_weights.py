"""Where a run's first weights come from when it resumes nothing: checkpoint.pretrained_checkpoint, a
kubetron or megatron checkpoint (kubetron.checkpoint reads those) or a Hugging Face model directory
(kubetron.hf converts it; the checkpoint manager is handed `load_hf`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kubetron.checkpoint import adapters, format_torch_dist
from kubetron.checkpoint.layout import COMMON, bridge_heads, check_architecture, resolve_checkpoint, safe_load


def load_hf(model: list[torch.nn.Module], cfg, path: str, keep: Callable[[str], bool] | None) -> dict | None:
    """The weights of the Hugging Face model directory `path` into this rank's model chunks (`keep(name)`:
    only some; LoRA: the base). Returns the HF base's record (kubetron.hf.generation); None: `path` is not
    a Hugging Face model directory (nothing loaded). The checkpoint manager's `load_hf`."""
    from kubetron.hf import is_hf_dir

    if not is_hf_dir(path):
        return None
    from kubetron.hf.generation import record_of_hf_dir
    from kubetron.hf.io import load_hf_into_model

    record = record_of_hf_dir(path)
    load_hf_into_model(model, cfg, path, keep=keep)
    return record


def check_before_build(cfg, *, finetune: bool) -> None:
    """What `CheckpointManager.load` will check that needs no model, before the model is built: the
    architecture of the checkpoint it will resume (checkpoint.load) or start from (pretrained_checkpoint: a
    kubetron or megatron checkpoint, or an HF directory's config.json) against `model:`. A mismatch is the
    same config error (exit 2) from every kind of checkpoint."""
    ck = cfg.checkpoint
    found = resolve_checkpoint(ck.load, ck.ckpt_step, cfg) if ck.load else None
    if found is None and (finetune or adapters.enabled(cfg)) and ck.pretrained_checkpoint:
        from kubetron.hf import is_hf_dir

        if is_hf_dir(ck.pretrained_checkpoint):
            from kubetron.hf.io import check_hf_dir

            return check_hf_dir(cfg, ck.pretrained_checkpoint)
        found = resolve_checkpoint(ck.pretrained_checkpoint, None, cfg, non_persistent=False)
    if found is None:
        return None
    store, name, _ = found
    if format_torch_dist.megatron_backend(store, name) is not None:
        return check_architecture(bridge_heads(store, name), cfg, name)
    common = safe_load(store.read_bytes(f"{name}/{COMMON}"), f"{name}/{COMMON}")
    sharded = common.get("ckpt_format") == "sharded"
    return check_architecture(common.get("model_config", {}), cfg, name,
                              saved_tokenizer_vocab=common.get("tokenizer_vocab_size") if sharded else None)
