"""What a consumer's `generate()` needs besides the weights: the special token ids and generation_config.json.

Without them transformers falls back to its class defaults (Llama: bos 1, eos 2) and generation never
stops at the end of text. The HF base's values travel with the weights as the `hf` record of every
checkpoint's common.pt: `import-hf` writes it, `finetune` copies it from its pretrained checkpoint (or
reads it from the HF directory given as `checkpoint.pretrained_checkpoint`) into each checkpoint it
saves, and `export-hf` writes it back out. The record:

    {"hf_dir": the HF directory (absolute), "special_tokens": config.json's bos/eos/pad_token_id,
     "generation_config": generation_config.json as read (None: the directory had none)}

A Llama-3-Instruct lists several stop ids (`eos_token_id: [...]` in generation_config.json): the file is
carried whole. A model trained from scratch has no record: its tokenizer gives the ids (eod is eos).
"""

from __future__ import annotations

import json
import os

from kubetron.contract.errors import ConfigError
from kubetron.hf import config_map

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION_CONFIG = "generation_config.json"


def record_of_hf_dir(hf_dir: str) -> dict:
    """The `hf` record of an HF model directory."""
    hf = config_map.read_hf_config(hf_dir)
    path = os.path.join(hf_dir, GENERATION_CONFIG)
    gen = None
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                gen = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(path, f"cannot read it as JSON: {e}") from None
    return {"hf_dir": os.path.abspath(hf_dir),
            "special_tokens": {k: hf[k] for k in SPECIAL_IDS if hf.get(k) is not None},
            "generation_config": gen}


def tokenizer_ids(tokenizer) -> dict:
    """bos/eos/pad ids of a kubetron tokenizer (eod is the end of text; None: it has no such token, so
    transformers' class default, e.g. Llama's bos 1, does not apply either)."""
    ids = {"bos_token_id": tokenizer.bos, "eos_token_id": tokenizer.eod, "pad_token_id": tokenizer.pad}
    return {k: None if v is None else int(v) for k, v in ids.items()}


def export_ids(record: dict | None, tokenizer) -> tuple[dict, dict]:
    """(the ids for config.json, generation_config.json) of an export: the HF base's (its config.json ids,
    its generation_config.json or else those ids), or for a model trained from scratch its tokenizer's."""
    if record:
        ids = dict(record.get("special_tokens") or {})
        return ids, dict(record.get("generation_config") or ids)
    ids = tokenizer_ids(tokenizer) if tokenizer is not None else {}
    return ids, dict(ids)
