"""Reading and writing: HF directories (config.json + *.safetensors) and kubetron checkpoints.

`import_hf` writes a checkpoint in the canonical layout training/checkpointing.py reads
(`iter_0000000/{model.pt, common.pt, run_config.yaml, tokenizer/}` + `metadata.json`, the commit
marker, written last through the store's transaction), so `checkpoint.pretrained_checkpoint=OUT`
loads it at any TP/PP (sharding.py slices canonical tensors). It holds weights only: `finetune`
starts from it; it is not a run to resume. Everything is read and converted before the first byte
is written, so a bad input leaves nothing behind.
"""

from __future__ import annotations

import glob
import io
import json
import os
from datetime import UTC, datetime

import torch
import yaml

from kubetron.errors import CheckpointError, ConfigError
from kubetron.hf import config_map, convert

# HF tokenizer files carried along (import: into the checkpoint; export: back out of it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
TOKENIZER_DIR = "tokenizer"
_ARCH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size", "rotary_base", "normalization", "activation", "add_bias_linear", "add_qkv_bias",
              "share_embeddings_and_output_weights", "position_embedding_type", "rope_scaling",
              "rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
              "rope_scaling_original_max_position_embeddings", "layernorm_epsilon")


def read_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise ConfigError("HF_DIR", f"{hf_dir}: no *.safetensors files (only safetensors weights are read)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(f))
        except Exception as e:  # a truncated or foreign file
            raise ConfigError("HF_DIR", f"{f}: not a readable safetensors file ({e})") from None
    return out


def _model_keys(hf_dir: str) -> dict:
    """The full `model:` section (defaults filled in) for an HF directory."""
    from kubetron.config import GPTModelConfig

    return GPTModelConfig(**config_map.model_section(config_map.read_hf_config(hf_dir))).model_dump()


def load_hf_canonical(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(model keys, canonical tensors) of an HF directory."""
    m = _model_keys(hf_dir)
    return m, convert.hf_to_canonical(read_hf_weights(hf_dir), m)


def model_yaml(m: dict, out: str | None = None, hf_dir: str | None = None) -> str:
    """The `model:` section to put into a run config, the checkpoint key pointing at `out` and, when the
    HF directory has a tokenizer, the tokenizer section reading the copy inside the checkpoint."""
    keep = {k: v for k, v in m.items() if k in _ARCH_KEYS or k in ("seq_length", "max_position_embeddings")}
    text = yaml.safe_dump({"model": keep}, sort_keys=False)
    if out:
        text += yaml.safe_dump({"checkpoint": {"pretrained_checkpoint": out}}, sort_keys=False)
        tok_dir = f"{out.rstrip('/')}/iter_0000000/{TOKENIZER_DIR}"
        if hf_dir and os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
            tok = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tok_dir}
        elif hf_dir and os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
            tok = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": f"{tok_dir}/tokenizer.model"}
        else:
            tok = None
        if tok:
            text += yaml.safe_dump({"tokenizer": tok}, sort_keys=False)
    return text


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def import_hf(hf_dir: str, out: str) -> dict:
    """Write `out`/iter_0000000 from the HF model in `hf_dir`; returns the model keys."""
    if not os.path.isdir(hf_dir):
        raise ConfigError("HF_DIR", f"{hf_dir}: no such directory")
    m, tensors = load_hf_canonical(hf_dir)  # every check before megatron-core is even imported
    from kubetron.storage import open_store
    from kubetron.training.checkpointing import ARCH_FIELDS, CHECKPOINT_VERSION, MARKER, committed_iterations, iter_dir

    store = open_store(out)
    if committed_iterations(store):
        raise ConfigError("OUT", f"{out} already holds a checkpoint; give an empty or new directory")
    common = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0,
              "model_config": {f: m[f] for f in ARCH_FIELDS}, "source": {"hf_dir": os.path.abspath(hf_dir)}}
    name = iter_dir(0)
    txn = store.begin_dir(name, txn_id="import-hf")
    try:
        txn.write_bytes("model.pt", _to_bytes(tensors))
        txn.write_bytes("common.pt", _to_bytes(common))
        txn.write_bytes("run_config.yaml", yaml.safe_dump({"model": m}, sort_keys=False).encode())
        for f in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(hf_dir, f)):
                with open(os.path.join(hf_dir, f), "rb") as fh:
                    txn.write_bytes(f"{TOKENIZER_DIR}/{f}", fh.read())
        marker = {"iteration": 0, "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "run_id": "import-hf",
                  "checkpoint_version": CHECKPOINT_VERSION, "world_size": 1}
        txn.commit(json.dumps(marker).encode())
    except Exception:
        txn.abort()
        raise
    assert store.exists(f"{name}/{MARKER}")
    return m


def read_checkpoint(location: str) -> tuple[dict, dict[str, torch.Tensor], object, str]:
    """(model keys, canonical tensors, store, iter dir) of a kubetron checkpoint (newest iteration)."""
    from types import SimpleNamespace

    from kubetron.training.checkpointing import _safe_load, resolve_checkpoint

    shim = SimpleNamespace(checkpoint=SimpleNamespace(s3_endpoint_url=os.environ.get("AWS_ENDPOINT_URL"),
                                                      s3_region=None))
    try:
        found = resolve_checkpoint(location, None, shim, non_persistent=False)
    except CheckpointError as e:
        raise ConfigError("CKPT", str(e)) from None
    if found is None:
        raise ConfigError("CKPT", f"{location}: holds no complete checkpoint")
    store, name, _ = found
    run_cfg = yaml.safe_load(store.read_bytes(f"{name}/run_config.yaml"))
    if store.exists(f"{name}/model.pt"):  # ckpt_format kubetron (and import-hf's output)
        with store.open_read(f"{name}/model.pt") as f:
            return run_cfg["model"], _safe_load(f, f"{name}/model.pt"), store, name
    common = _safe_load(store.read_bytes(f"{name}/common.pt"), f"{name}/common.pt")
    if common.get("ckpt_format") != "sharded":
        raise ConfigError("CKPT", f"{location}/{name}: export-hf reads checkpoints saved with "
                                  "checkpoint.ckpt_format sharded or kubetron, not torch_dist")
    from kubetron.training.sharded import read_canonical

    # The sharded format keeps a gated fc1 (and its LoRA B) as (2, ffn, ...) = [gate, up]; canonical is [gate; up].
    tensors = {k: (t.reshape(-1, t.shape[-1]) if ".mlp.linear_fc1." in k and t.ndim == 3 else t)
               for k, t in read_canonical(store, name)[0].items()}
    return run_cfg["model"], tensors, store, name


def _lora_record(store, name: str) -> dict | None:
    """common.pt's `peft` entry: set for an adapter-only (LoRA) checkpoint."""
    from kubetron.training.checkpointing import _safe_load

    if not store.exists(f"{name}/common.pt"):
        return None
    return _safe_load(store.read_bytes(f"{name}/common.pt"), f"{name}/common.pt").get("peft")


def _read_base(location: str | None) -> dict[str, torch.Tensor]:
    """Canonical tensors of a LoRA checkpoint's base (a kubetron checkpoint or an HF directory)."""
    from kubetron.hf import is_hf_dir

    if not location:
        raise ConfigError("CKPT", "the LoRA checkpoint names no pretrained_checkpoint to merge into")
    return load_hf_canonical(location)[1] if is_hf_dir(location) else read_checkpoint(location)[1]


def export_hf(location: str, out: str, adapter_only: bool = False) -> dict:
    """Write `out`/{config.json, model.safetensors, tokenizer files} from a kubetron checkpoint. A LoRA
    checkpoint's adapters are merged into its base; with `adapter_only`, `out` gets a PEFT adapter."""
    from safetensors.torch import save_file

    from kubetron.hf import lora

    m, tensors, store, name = read_checkpoint(location)
    info = _lora_record(store, name)
    if adapter_only and info is None:
        raise ConfigError("--adapter-only", f"{location}/{name} is not a LoRA (peft) checkpoint")
    if info is not None:
        pairs = lora.adapters(tensors)
        if adapter_only:
            lora.write_peft(out, pairs, info, m)
            return lora.peft_config(info)
        tensors = lora.merge(_read_base(info.get("pretrained_checkpoint")), pairs, info["alpha"] / info["dim"])
    cfg = config_map.hf_config(m)
    try:
        hf = convert.canonical_to_hf(tensors, m)
    except KeyError as e:
        raise ConfigError("CKPT", f"{location}/{name}: tensor {e} missing for this model") from None
    dtypes = {str(t.dtype).removeprefix("torch.") for t in hf.values()}
    cfg["torch_dtype"] = cfg["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    tok_files = store.list(f"{name}/{TOKENIZER_DIR}")  # what import-hf (or the trainer) saved with it
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, "config.json")):
        raise ConfigError("OUT", f"{out} already holds a config.json; give an empty or new directory")
    save_file(hf, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for key in tok_files:
        with open(os.path.join(out, os.path.basename(key)), "wb") as f:
            f.write(store.read_bytes(key))
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:  # last: marks a complete export
        json.dump(cfg, f, indent=2)
    return cfg


def load_hf_into_model(model, cfg, hf_dir: str, keep=None):
    """checkpoint.pretrained_checkpoint = an HF directory: its weights into this rank's model parts
    (`keep(name)`: only some; LoRA: the base)."""
    from kubetron.training import sharding

    m, tensors = load_hf_canonical(hf_dir)
    diffs = [f"model.{k}: HF {m[k]!r}, this run {getattr(cfg.model, k)!r}" for k in _ARCH_KEYS
             if m[k] != getattr(cfg.model, k)]
    if diffs:
        raise CheckpointError(f"{hf_dir} does not match this model (`kubetron import-hf` prints the model "
                              "section): " + "; ".join(diffs[:4]))
    sharding.load_model_state(model, tensors, keep=keep)
