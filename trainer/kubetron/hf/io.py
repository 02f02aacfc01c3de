"""Reading and writing: HF directories (config.json + *.safetensors) and kubetron checkpoints.

`import_hf` writes a checkpoint in the canonical layout kubetron/checkpoint/ reads
(`iter_0000000/{model.pt, common.pt, run_config.yaml, tokenizer/}` + `metadata.json`, the commit
marker, written last through the store's transaction), so `checkpoint.pretrained_checkpoint=OUT`
loads it at any TP/PP (checkpoint/canonical.py slices canonical tensors). It holds weights only: `finetune`
starts from it; it is not a run to resume. Everything is read and converted before the first byte
is written, so a bad input leaves nothing behind.
"""

from __future__ import annotations

import glob
import json
import os

import torch
import yaml

from kubetron.checkpoint.layout import (
    CHECKPOINT_VERSION,
    COMMON,
    HF_ARCH_FIELDS,
    MARKER,
    RUN_CONFIG,
    TOKENIZER_DIR,
    arch_record,
    arch_value,
    committed_iterations,
    iter_dir,
    resolve_checkpoint,
    safe_load,
    to_bytes,
)
from kubetron.contract.errors import CheckpointError, ConfigError
from kubetron.contract.times import stamp
from kubetron.hf import config_map, convert, generation

# HF tokenizer files carried along (import: into the checkpoint; export: back out of it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
_MOE_TRAINING_KEYS = ("moe_router_load_balancing_type", "moe_aux_loss_coeff")  # carried and printed; no architecture
_UNSET_IS_DEFAULT = ("sliding_window", "kv_channels", "moe_shared_expert_intermediate_size")  # not printed when null


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
    from kubetron.contract.config import GPTModelConfig

    return GPTModelConfig(**config_map.model_section(config_map.read_hf_config(hf_dir))).model_dump()


def load_hf_canonical(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(model keys, canonical tensors) of an HF directory."""
    m = _model_keys(hf_dir)
    return m, convert.hf_to_canonical(read_hf_weights(hf_dir), m)


def model_yaml(m: dict, out: str | None = None, hf_dir: str | None = None) -> str:
    """The `model:` section to put into a run config, the checkpoint key pointing at `out` and, when the
    HF directory has a tokenizer, the tokenizer section reading the copy inside the checkpoint."""
    keep = {k: v for k, v in m.items() if _printed(k, v, m)}
    text = yaml.safe_dump({"model": keep}, sort_keys=False)
    if out:
        text += yaml.safe_dump({"checkpoint": {"pretrained_checkpoint": out}}, sort_keys=False)
        tok_dir = f"{out.rstrip('/')}/{iter_dir(0)}/{TOKENIZER_DIR}"
        if hf_dir and os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
            tok = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tok_dir}
        elif hf_dir and os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
            tok = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": f"{tok_dir}/tokenizer.model"}
        else:
            tok = None
        if tok:
            text += yaml.safe_dump({"tokenizer": tok}, sort_keys=False)
    return text


def _printed(key: str, value, m: dict) -> bool:
    """A key of the printed `model:` section: the architecture and the lengths; MoE keys only with experts."""
    if key in ("seq_length", "max_position_embeddings"):
        return True
    if key not in HF_ARCH_FIELDS + _MOE_TRAINING_KEYS or (key in _UNSET_IS_DEFAULT and value is None):
        return False
    return m.get("num_moe_experts") is not None or not (key.startswith("moe_") or key == "num_moe_experts")


def import_hf(hf_dir: str, out: str) -> dict:
    """Write `out`/iter_0000000 from the HF model in `hf_dir`; returns the model keys."""
    if not os.path.isdir(hf_dir):
        raise ConfigError("HF_DIR", f"{hf_dir}: no such directory")
    m, tensors = load_hf_canonical(hf_dir)  # every check before megatron-core is even imported
    from kubetron.checkpoint import format_kubetron
    from kubetron.contract.config import GPTModelConfig
    from kubetron.storage import open_store

    store = open_store(out)
    if committed_iterations(store):
        raise ConfigError("OUT", f"{out} already holds a checkpoint; give an empty or new directory")
    common = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0,
              "model_config": arch_record(GPTModelConfig(**m)), "source": {"hf_dir": os.path.abspath(hf_dir)},
              "hf": generation.record_of_hf_dir(hf_dir)}
    name = iter_dir(0)
    txn = store.begin_dir(name, txn_id="import-hf")
    try:
        txn.write_bytes(format_kubetron.MODEL, to_bytes(tensors))
        txn.write_bytes(COMMON, to_bytes(common))
        txn.write_bytes(RUN_CONFIG, yaml.safe_dump({"model": m}, sort_keys=False).encode())
        for f in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(hf_dir, f)):
                with open(os.path.join(hf_dir, f), "rb") as fh:
                    txn.write_bytes(f"{TOKENIZER_DIR}/{f}", fh.read())
        marker = {"iteration": 0, "time": stamp(), "run_id": "import-hf",
                  "checkpoint_version": CHECKPOINT_VERSION, "world_size": 1}
        txn.commit(json.dumps(marker).encode())
    except Exception:
        txn.abort()
        raise
    assert store.exists(f"{name}/{MARKER}")
    return m


def _resolve(location: str) -> tuple[object, str]:
    """(store, iter dir) of the newest complete checkpoint at `location`."""
    from types import SimpleNamespace

    shim = SimpleNamespace(checkpoint=SimpleNamespace(s3_endpoint_url=os.environ.get("AWS_ENDPOINT_URL"),
                                                      s3_region=None))
    try:
        found = resolve_checkpoint(location, None, shim, non_persistent=False)
    except CheckpointError as e:
        raise ConfigError("CKPT", str(e)) from None
    if found is None:
        raise ConfigError("CKPT", f"{location}: holds no complete checkpoint")
    return found[0], found[1]


def read_checkpoint(location: str) -> tuple[dict, dict[str, torch.Tensor], object, str]:
    """(model keys, canonical tensors, store, iter dir) of a kubetron checkpoint (newest iteration)."""
    from kubetron.checkpoint import format_kubetron, format_sharded

    store, name = _resolve(location)
    run_cfg = yaml.safe_load(store.read_bytes(f"{name}/{RUN_CONFIG}"))
    model_pt = f"{name}/{format_kubetron.MODEL}"
    if store.exists(model_pt):  # ckpt_format kubetron (and import-hf's output)
        with store.open_read(model_pt) as f:
            return run_cfg["model"], safe_load(f, model_pt), store, name
    common = safe_load(store.read_bytes(f"{name}/{COMMON}"), f"{name}/{COMMON}")
    if common.get("ckpt_format") != "sharded":
        raise ConfigError("CKPT", f"{location}/{name}: export-hf reads checkpoints saved with "
                                  "checkpoint.ckpt_format sharded or kubetron, not torch_dist")
    # The sharded format keeps a gated fc1 (a dense layer's or an expert's, and its LoRA B) as (2, ffn, ...) =
    # [gate, up]; canonical is [gate; up].
    tensors = {k: (t.reshape(-1, t.shape[-1]) if ".linear_fc1." in k and t.ndim == 3 else t)
               for k, t in format_sharded.read_canonical(store, name)[0].items()}
    return run_cfg["model"], tensors, store, name


def _common(store, name: str) -> dict:
    """common.pt of a checkpoint ({} if it has none): `peft` is set for an adapter-only (LoRA) checkpoint,
    `hf` is its HF base's record (kubetron.hf.generation), `source` marks import-hf's output."""
    if not store.exists(f"{name}/{COMMON}"):
        return {}
    return safe_load(store.read_bytes(f"{name}/{COMMON}"), f"{name}/{COMMON}")


def _run_tokenizer(store, name: str, assets: dict[str, bytes]):
    """The tokenizer a checkpoint was trained with (None: its run_config names none, as import-hf's)."""
    from kubetron.data.tokenizer import FILE_TOKENIZERS, build_tokenizer, tokenizer_from_assets

    tok = (yaml.safe_load(store.read_bytes(f"{name}/{RUN_CONFIG}")) or {}).get("tokenizer") or {}
    kind = tok.get("tokenizer_type")
    if kind is None or (kind in FILE_TOKENIZERS and not assets):
        return None
    if kind in FILE_TOKENIZERS:
        return tokenizer_from_assets(kind, assets, f"{name}/{TOKENIZER_DIR}")
    return build_tokenizer(kind, tok.get("vocab_size"))


def _read_base(location: str | None) -> dict[str, torch.Tensor]:
    """Canonical tensors of a LoRA checkpoint's base (a kubetron checkpoint or an HF directory)."""
    from kubetron.hf import is_hf_dir

    if not location:
        raise ConfigError("CKPT", "the LoRA checkpoint names no pretrained_checkpoint to merge into")
    return load_hf_canonical(location)[1] if is_hf_dir(location) else read_checkpoint(location)[1]


def peft_base_name(base: str | None) -> str:
    """PEFT's `base_model_name_or_path` for adapters trained on `base`: the HF directory whose weights the
    base holds (the directory itself, or the one import-hf converted). A trained kubetron checkpoint is
    no HF model transformers can load: refused."""
    from kubetron.hf import is_hf_dir

    if not base:
        raise ConfigError("CKPT", "the LoRA checkpoint names no pretrained_checkpoint (its base)")
    if is_hf_dir(base):
        return os.path.abspath(base)
    store, name = _resolve(base)
    hf_dir = (_common(store, name).get("source") or {}).get("hf_dir")
    if not hf_dir:
        raise ConfigError("--adapter-only", f"the adapters' base {base} is a kubetron checkpoint, not a Hugging "
                                            "Face model transformers can load: export the merged weights instead")
    return hf_dir


def export_hf(location: str, out: str, adapter_only: bool = False) -> dict:
    """Write `out`/{config.json, generation_config.json, model.safetensors, tokenizer files} from a kubetron
    checkpoint. A LoRA checkpoint's adapters are merged into its base; with `adapter_only`, `out` gets a
    PEFT adapter naming the base's HF directory."""
    from kubetron.hf import lora

    m, tensors, store, name = read_checkpoint(location)
    common = _common(store, name)
    info = common.get("peft")
    if adapter_only and info is None:
        raise ConfigError("--adapter-only", f"{location}/{name} is not a LoRA (peft) checkpoint")
    if info is not None:
        pairs = lora.adapters(tensors)
        if adapter_only:
            return lora.write_peft(out, pairs, info, m, peft_base_name(info.get("pretrained_checkpoint")))
        tensors = lora.merge(_read_base(info.get("pretrained_checkpoint")), pairs, info["alpha"] / info["dim"])
    cfg = config_map.hf_config(m)
    try:
        hf = convert.canonical_to_hf(tensors, m)
    except KeyError as e:
        raise ConfigError("CKPT", f"{location}/{name}: tensor {e} missing for this model") from None
    dtypes = {str(t.dtype).removeprefix("torch.") for t in hf.values()}
    cfg["torch_dtype"] = cfg["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    _write_export(out, hf, _export_files(store, name, common.get("hf"), cfg), cfg)
    return cfg


def _export_files(store, name: str, record: dict | None, cfg: dict) -> dict[str, bytes]:
    """The tokenizer files the checkpoint holds and generation_config.json; the special ids go into `cfg`:
    the HF base's (`record`), else (a model trained from scratch) the tokenizer's."""
    files = {os.path.basename(k): store.read_bytes(k) for k in store.list(f"{name}/{TOKENIZER_DIR}")}
    ids, gen = generation.export_ids(record, None if record else _run_tokenizer(store, name, files))
    cfg.update(ids)
    if gen:  # else an older import's copy in tokenizer/, if any
        files[generation.GENERATION_CONFIG] = json.dumps(gen, indent=2).encode()
    return files


def _write_export(out: str, hf: dict[str, torch.Tensor], files: dict[str, bytes], cfg: dict):
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, "config.json")):
        raise ConfigError("OUT", f"{out} already holds a config.json; give an empty or new directory")
    save_file(hf, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for file_name, data in files.items():
        with open(os.path.join(out, file_name), "wb") as f:
            f.write(data)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:  # last: marks a complete export
        json.dump(cfg, f, indent=2)


def load_hf_into_model(model, cfg, hf_dir: str, keep=None):
    """checkpoint.pretrained_checkpoint = an HF directory: its weights into this rank's model parts
    (`keep(name)`: only some; LoRA: the base)."""
    from kubetron.checkpoint import canonical
    from kubetron.contract.config import GPTModelConfig

    m, tensors = load_hf_canonical(hf_dir)
    hf_model = GPTModelConfig(**m)
    diffs = [f"model.{k}: HF {arch_value(hf_model, k)!r}, this run {arch_value(cfg.model, k)!r}" for k in HF_ARCH_FIELDS
             if arch_value(hf_model, k) != arch_value(cfg.model, k)]
    if diffs:
        raise CheckpointError(f"{hf_dir} does not match this model (`kubetron import-hf` prints the model "
                              "section): " + "; ".join(diffs[:4]))
    canonical.load_model_state(model, tensors, keep=keep)
