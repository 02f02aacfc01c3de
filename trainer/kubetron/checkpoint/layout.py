"""The on-store layout of a checkpoint: names, the commit marker, the tracker, the version, the architecture
record, which iteration to load, and the one safe way to read a file back.

    <save>/iter_0000020/{common.pt, run_config.yaml, tokenizer/*, rng/rank_NNNNN.pt, <format's files>,
                         metadata.json}          metadata.json = commit marker, written last
    <save>/latest_train_state.pt                 tracker, replaced atomically after the commit
    <save>/non_persistent/iter_0000025/...       non-persistent "global" saves (the newest only)
    <save>/progress.txt                          "Saved checkpoint" appended once durable

The format's files: format_sharded.py (shards/), format_kubetron.py (model.pt, optim.pt),
format_torch_dist.py (dist/). Every load is `torch.load(..., weights_only=True)` (safe_load): a
checkpoint can never run code.
"""

from __future__ import annotations

import io
import logging
import pickle
import re

import torch
import torch.distributed as dist
import yaml

from kubetron.contract.errors import CheckpointError, ConfigError
from kubetron.storage import MARKER, open_store

log = logging.getLogger("kubetron")

# MARKER ("metadata.json", the commit marker) is the store's: its transactions commit with it.
__all__ = ["MARKER"]

TRACKER = "latest_train_state.pt"
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
NON_PERSISTENT = "non_persistent"
TOKENIZER_DIR = "tokenizer"
COMMON = "common.pt"  # counters, scheduler, data position, architecture, version (rank 0)
RUN_CONFIG = "run_config.yaml"  # the resolved config
CHECKPOINT_VERSION = 1
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# Architecture fields that must match between a checkpoint and the model loading it.
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "vocab_size", "position_embedding_type", "normalization", "activation", "add_bias_linear",
               "share_embeddings_and_output_weights", "sliding_window", "qk_layernorm", "kv_channels",
               "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
               "moe_shared_expert_intermediate_size")
# What else an HF import prints into the `model:` section and checks against the run loading HF weights:
# fields that change what the model computes but not its tensors.
HF_ARCH_FIELDS = ARCH_FIELDS + ("rotary_base", "add_qkv_bias", "rope_scaling", "rope_scaling_factor",
                                "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                                "rope_scaling_original_max_position_embeddings", "layernorm_epsilon")


def arch_value(model, field: str):
    """A field of a `model:` section (GPTModelConfig) as it decides the architecture: kv_channels is the
    head size (null and hidden_size / num_attention_heads are the same model); the moe_ fields only with
    experts (null for a dense model), moe_layer_freq as one 0/1 per layer, moe_ffn_hidden_size resolved."""
    if field == "kv_channels":
        return model.head_size()
    if field.startswith("moe_") and model.num_moe_experts is None:
        return None
    if field == "moe_layer_freq":
        return model.moe_layer_pattern()
    if field == "moe_ffn_hidden_size":
        return model.moe_ffn_hidden_size or model.ffn_hidden_size
    return getattr(model, field)


def arch_record(model) -> dict:
    """The ARCH_FIELDS of a `model:` section, as common.pt records them."""
    return {f: arch_value(model, f) for f in ARCH_FIELDS}


def iter_dir(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rng_file(rank: int) -> str:
    """A rank's random generators' states, inside an iteration's directory."""
    return f"rng/rank_{rank:05d}.pt"


def safe_load(data: bytes | io.IOBase, what: str):
    """torch.load that refuses anything but tensors and plain containers (no code from a store)."""
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:200]
        raise CheckpointError(f"refusing to load {what}: it holds objects other than tensors and plain "
                              f"data, and loading it could run code ({first})") from None
    except Exception as e:  # truncated/corrupt file
        raise CheckpointError(f"cannot read {what}: {type(e).__name__}: {e}") from None


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def committed_iterations(store, prefix: str = "") -> list[int]:
    """Iterations with a commit marker, oldest first (partial saves are invisible)."""
    base = (prefix.rstrip("/") + "/") if prefix else ""
    its = []
    for d in store.list_dirs(base):
        m = _ITER_RE.match(d)
        if m and store.exists(f"{base}{d}/{MARKER}"):
            its.append(int(m.group(1)))
    return sorted(its)


def tracked_iteration(store) -> int | None:
    """The iteration the tracker names: kubetron's `latest_train_state.pt` ({"iteration": ...}), Megatron
    Bridge's (its TrainState, {"step": ...}) or Megatron-LM's `latest_checkpointed_iteration.txt`."""
    if store.exists(TRACKER):
        tracker = safe_load(store.read_bytes(TRACKER), TRACKER)
        value = tracker.get("iteration", tracker.get("step")) if isinstance(tracker, dict) else None
    elif store.exists(MEGATRON_LM_TRACKER):
        value = store.read_bytes(MEGATRON_LM_TRACKER).decode(errors="replace").strip()
    else:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"{store.url}: the tracker names no iteration ({str(value)[:40]!r})") from None


def resolve_checkpoint(location: str, ckpt_step: int | None, cfg, non_persistent: bool = True):
    """(store, dir name, iteration) of the checkpoint to load, or None if there is none.

    `location` may be an iter_ directory itself. Otherwise: ckpt_step if given; else the tracker,
    checked against its commit marker, else the newest committed iteration; a newer non-persistent
    checkpoint wins.
    """
    ck = cfg.checkpoint
    loc = location.rstrip("/")
    parent, _, leaf = loc.rpartition("/")
    m = _ITER_RE.match(leaf)
    if m:  # an iter_ directory itself (`iter_0000030` alone means ./iter_0000030)
        store = open_store(parent or ".", endpoint_url=ck.s3_endpoint_url, region=ck.s3_region)
        if not store.exists(f"{leaf}/{MARKER}"):
            raise CheckpointError(f"{location} is not a complete checkpoint (no {MARKER})")
        return store, leaf, int(m.group(1))
    store = open_store(loc, endpoint_url=ck.s3_endpoint_url, region=ck.s3_region)
    durable = committed_iterations(store)
    if ckpt_step is not None:
        if ckpt_step not in durable:
            raise ConfigError("checkpoint.ckpt_step", f"{ckpt_step}: {loc} has no complete {iter_dir(ckpt_step)}"
                                                      f" (complete: {durable[-5:]})")
        return store, iter_dir(ckpt_step), ckpt_step
    best = None
    tracked = tracked_iteration(store)
    if tracked is not None:
        if tracked in durable:
            best = tracked
        else:
            log.warning("tracker points at iteration %d which is not complete; using the newest complete one",
                        tracked)
    if best is None and durable:
        best = durable[-1]
    candidates = [] if best is None else [(best, iter_dir(best))]
    if non_persistent:
        np_its = committed_iterations(store, NON_PERSISTENT)
        if np_its:
            candidates.append((np_its[-1], f"{NON_PERSISTENT}/{iter_dir(np_its[-1])}"))
    if not candidates:
        return None
    iteration, name = max(candidates)
    return store, name, iteration


def check_version(common: dict, store, name: str, field: str = "checkpoint.load"):
    """A checkpoint written by a newer kubetron (unknown layout) is refused with one line naming `field`."""
    version = common.get("checkpoint_version")
    if not isinstance(version, int) or not 1 <= version <= CHECKPOINT_VERSION:
        raise ConfigError(field, f"{store.url}/{name} has checkpoint version {version!r}; this kubetron "
                                 f"reads versions 1..{CHECKPOINT_VERSION} (use the kubetron that wrote it)")


def tokenizer_vocab(cfg) -> int | None:
    """The tokenizer's own vocabulary (before padding), when the config names one."""
    try:
        return cfg.tokenizer.base_vocab_size()
    except ConfigError:
        return None


def check_architecture(saved: dict, cfg, name: str, saved_tokenizer_vocab: int | None = None):
    """Resume asserts what it restores: the model shape must match, field by field. A sharded
    checkpoint may differ in the padded vocabulary (it grows with TP) when the tokenizer is the same."""
    same_tokenizer = saved_tokenizer_vocab is not None and saved_tokenizer_vocab == tokenizer_vocab(cfg)
    current = arch_record(cfg.model)
    diffs = [f"model.{k}: checkpoint {saved[k]!r}, this run {current[k]!r}"
             for k in ARCH_FIELDS if k in saved and saved[k] != current[k]
             and not (k == "vocab_size" and same_tokenizer)]
    if diffs:  # a spec error no retry fixes (exit 2): the first differing field is named
        field = diffs[0].split(":")[0]
        raise ConfigError(field, f"{name} does not match this model: " + "; ".join(diffs))


def bridge_heads(store, name: str) -> dict:
    """num_attention_heads / num_query_groups from a Megatron Bridge checkpoint's run_config.yaml (safe YAML;
    {} without one, e.g. Megatron-LM's, whose args sit in a pickle that is never read)."""
    key = f"{name}/{RUN_CONFIG}"
    if not store.exists(key):
        return {}
    try:
        model = (yaml.safe_load(store.read_bytes(key)) or {}).get("model") or {}
    except (yaml.YAMLError, AttributeError) as e:
        log.warning("%s: not read (%s); the attention heads are not checked", key, str(e).splitlines()[0][:100])
        return {}
    heads = model.get("num_attention_heads")
    groups = model.get("num_query_groups") or heads
    return {k: v for k, v in (("num_attention_heads", heads), ("num_query_groups", groups)) if isinstance(v, int)}


def read_tokenizer_assets(store, name: str) -> dict[str, bytes]:
    """{file name: bytes} of a checkpoint's tokenizer/ directory ({} for byte/null or older checkpoints)."""
    prefix = f"{name}/{TOKENIZER_DIR}/"
    return {key[len(prefix):]: store.read_bytes(key) for key in store.list(prefix.rstrip("/"))
            if key.startswith(prefix)}


def run_config_changes(saved_yaml: str, cfg) -> list[str]:
    """`section.key: old -> new` for every setting that differs from the saved run_config.yaml."""
    saved = yaml.safe_load(saved_yaml) or {}
    now = cfg.to_dict()
    changes = []
    for section, values in saved.items():
        if not isinstance(values, dict) or not isinstance(now.get(section), dict):
            continue
        for key, old in values.items():
            new = now[section].get(key, old)
            if new != old:
                changes.append(f"{section}.{key}: {old!r} -> {new!r}")
    return changes


def log_run_config_changes(store, name: str, cfg):
    """A resume reads the run_config.yaml it resumes from and names what this run changes."""
    key = f"{name}/{RUN_CONFIG}"
    if (dist.get_rank() if dist.is_initialized() else 0) != 0 or not store.exists(key):
        return
    changes = run_config_changes(store.read_bytes(key).decode(), cfg)
    if changes:
        log.info("settings changed since %s: %s", name, "; ".join(changes))
