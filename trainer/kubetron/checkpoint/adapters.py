"""Adapter-only checkpoints (`peft.scheme: lora`): which tensors are adapters, what common.pt records of
them, and which tensors a checkpoint fills. The adapters themselves are kubetron.training.peft's; their
tensors are named `<linear>.adapter.linear_in.weight` / `<linear>.adapter.linear_out.weight`."""

from __future__ import annotations

import logging

from kubetron.contract.errors import ConfigError

log = logging.getLogger("kubetron")

ADAPTER = ".adapter."


def enabled(cfg) -> bool:
    return getattr(getattr(cfg, "peft", None), "scheme", None) == "lora"


def is_adapter_name(name: str) -> bool:
    return ADAPTER in f".{name}"


def is_base_name(name: str) -> bool:
    return not is_adapter_name(name)


def checkpoint_info(cfg) -> dict | None:
    """What common.pt records of an adapter-only checkpoint (None: a full one)."""
    if not enabled(cfg):
        return None
    p = cfg.peft
    return {"scheme": p.scheme, "dim": p.dim, "alpha": p.alpha, "target_modules": list(p.target_modules),
            "dropout": p.dropout, "dropout_position": p.dropout_position,
            "pretrained_checkpoint": cfg.checkpoint.pretrained_checkpoint}


def load_filter(saved: dict | None, cfg, name: str, *, as_pretrained: bool):
    """Which of this model's tensors a checkpoint (common.pt's `peft` entry: `saved`) fills: an
    adapter-only one the adapters (the base comes from pretrained_checkpoint), a full one into a LoRA
    model the base (adapters keep their initialisation); None: all. A mismatch is a config error (exit 2):
    no retry fixes it."""
    if saved is None:
        return is_base_name if enabled(cfg) else None
    only = f"{name} holds LoRA adapters only (base: {saved.get('pretrained_checkpoint')})"
    if as_pretrained:
        raise ConfigError("checkpoint.pretrained_checkpoint", f"{only}: merge them with `kubetron export-hf` "
                                                              "to fine-tune from them")
    if not enabled(cfg):
        raise ConfigError("peft.scheme", f"{only}: resume it with the peft section it was trained with")
    p = cfg.peft
    for key, mine in (("dim", p.dim), ("target_modules", list(p.target_modules))):
        if saved.get(key) != mine:
            raise ConfigError(f"peft.{key}", f"{name} holds adapters with {key} {saved.get(key)}, this run {mine}")
    if saved.get("pretrained_checkpoint") != cfg.checkpoint.pretrained_checkpoint:
        log.warning("%s was trained on base %s; this run loads the base from %s", name,
                    saved.get("pretrained_checkpoint"), cfg.checkpoint.pretrained_checkpoint)
    return is_adapter_name
