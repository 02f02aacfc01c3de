"""The on-store layout of a checkpoint: names, the commit marker, the tracker, the version, the architecture
record, which iteration to load, and the one safe way to read a file back.

    <save>/iter_0000020/{common.pt, run_config.yaml, tokenizer/*, rng/rank_NNNNN.pt, <format's files>,
                         metadata.json}          metadata.json = commit marker, written last
    <save>/latest_train_state.pt                 tracker, replaced atomically after the commit
    <save>/non_persistent/iter_0000025/...       non-persistent "global" saves (the newest only)
    <save>/progress.txt                          "Saved checkpoint" appended once durable

The format's files: format_sharded.py (shards/), format_kubetron.py (model.pt, optim.pt),
format_torch_dist.py (dist/). A checkpoint is data, never code, and hostile input:
- every .pt is read by safe_load: a torch.save zip whose records are stored uncompressed inside the file
  (so memory stays within the file's size), then `torch.load(..., weights_only=True)`;
- JSON and YAML (markers, indexes, run_config.yaml) by json.loads / yaml.safe_load;
- small files with a size limit (MAX_SMALL, MAX_INDEX), checked before their bytes are held;
- values from a checkpoint reach messages through `brief` (a bounded repr: a pickle or YAML of shared
  references can stand for an exponentially large structure).
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import re
import reprlib
import zipfile
from typing import IO, Any

import torch
import torch.distributed as dist
import yaml

from kubetron.contract.errors import CheckpointError, ConfigError
from kubetron.data.tokenizer import CHAT_TEMPLATE_DIR
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
MAX_SMALL = 16 << 20  # bytes: tracker, commit marker, run_config.yaml, RNG state (kubetron writes KBs)
MAX_INDEX = 256 << 20  # bytes: common.pt, a shard's JSON index, one tokenizer file (MBs at the largest sizes)
# the dtypes a saved tensor may have (parameters and optimizer state), by the name torch prints without "torch."
TENSOR_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64",
                                                         "int32", "int16", "int8", "uint8", "bool")}
MAX_NDIM = 8  # dimensions of a saved tensor
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
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


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of a seekable binary file, as a file of their own (a record inside a
    larger file, as torch DCP stores one tensor chunk; or the whole file)."""

    def __init__(self, f, start: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) if n else 0
        self.pos += got
        return got


def check_torch_zip(f, what: str, start: int = 0, length: int | None = None):
    """Refuse what torch.load could inflate beyond its size: `f` (bytes [start, start + length) of it) must be
    a torch.save zip archive whose records are all stored (torch.save never compresses; a deflated record of
    a few MB can stand for any size) and lie inside it. The legacy (pre-1.6) format is not read either."""
    if length is None:
        length = f.seek(0, io.SEEK_END) - start
    try:
        records = zipfile.ZipFile(_Window(f, start, length)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise CheckpointError(f"refusing to load {what}: not a torch.save zip archive ({e})") from None
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED or r.compress_size != r.file_size \
                or r.header_offset + r.compress_size > length:
            raise CheckpointError(f"refusing to load {what}: record {brief(r.filename)} is compressed or lies "
                                  "outside the file (torch.save writes neither)")


def safe_load(data: bytes | IO[bytes], what: str):
    """torch.load that refuses anything but tensors and plain containers (no code from a store), of a zip
    archive check_torch_zip accepts (memory within the file's size)."""
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    check_torch_zip(f, what)
    f.seek(0)
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [_ANSI.sub("", ln).strip() for ln in str(e).splitlines()]  # torch's text has bold escapes
        why = next((ln.split("error:", 1)[1].strip() for ln in lines if "WeightsUnpickler error:" in ln), lines[0])
        raise CheckpointError(f"refusing to load {what}: it holds objects other than tensors and plain "
                              f"data, and loading it could run code ({why.split('. ')[0][:200]})") from None
    except Exception as e:  # truncated/corrupt file
        raise CheckpointError(f"cannot read {what}: {type(e).__name__}: {str(e).strip()[:300]}") from None


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlist, _BRIEF.maxdict = 3, 80, 80, 8, 8


def brief(value) -> str:
    """A bounded repr of a value read from a checkpoint (for messages)."""
    return _BRIEF.repr(value)


def read_json(store, key: str, limit: int = MAX_SMALL):
    """A JSON file of the store, at most `limit` bytes; anything but JSON is a CheckpointError."""
    try:
        return json.loads(store.read_bytes(key, limit=limit))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{store.url}/{key} is not JSON: {type(e).__name__}: {str(e)[:200]}") from None


def read_yaml(store, key: str):
    """A checkpoint's YAML file (yaml.safe_load: plain data only, at most MAX_SMALL bytes); None, with a
    warning, when it is not YAML (only logs and checks that can do without it read one)."""
    data = store.read_bytes(key, limit=MAX_SMALL)
    try:
        return yaml.safe_load(data)
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        log.warning("%s/%s: not read (%s)", store.url, key, str(e).splitlines()[0][:100])
        return None


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
        tracker = safe_load(store.read_bytes(TRACKER, limit=MAX_SMALL), TRACKER)
        value: Any = tracker.get("iteration", tracker.get("step")) if isinstance(tracker, dict) else None
    elif store.exists(MEGATRON_LM_TRACKER):
        value = store.read_bytes(MEGATRON_LM_TRACKER, limit=MAX_SMALL).decode(errors="replace").strip()
    else:
        return None
    try:
        return int(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
        raise CheckpointError(f"{store.url}: the tracker names no iteration ({brief(value)})") from None


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
        raise ConfigError(field, f"{store.url}/{name} has checkpoint version {brief(version)}; this kubetron "
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
    diffs = [f"model.{k}: checkpoint {brief(saved[k])}, this run {current[k]!r}"
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
    saved = read_yaml(store, key)
    model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(model, dict):
        log.warning("%s: no model section read; the attention heads are not checked", key)
        return {}
    heads = model.get("num_attention_heads")
    groups = model.get("num_query_groups") or heads
    return {k: v for k, v in (("num_attention_heads", heads), ("num_query_groups", groups)) if isinstance(v, int)}


# A plain file name, or a named chat template in transformers' folder of them (additional_chat_templates/NAME.jinja).
_ASSET_NAME = re.compile(rf"({re.escape(CHAT_TEMPLATE_DIR)}/)?[A-Za-z0-9_][A-Za-z0-9_.\-]{{0,200}}")


def read_tokenizer_assets(store, name: str) -> dict[str, bytes]:
    """{file name: bytes} of a checkpoint's tokenizer/ directory ({} for byte/null or older checkpoints).
    These files are copied into every later checkpoint, so an entry that is not a plain file kubetron could
    have written (a link: the store refuses reading it; a subdirectory, an odd name, a huge file) stops the
    run with one line rather than being left out, which would silently change the tokenizer."""
    prefix = f"{name}/{TOKENIZER_DIR}/"
    assets = {}
    for key in store.list(prefix.rstrip("/")):
        file_name = key[len(prefix):]
        if not _ASSET_NAME.fullmatch(file_name):
            raise CheckpointError(f"{store.url}/{key}: not a tokenizer file kubetron writes (plain names only)")
        assets[file_name] = store.read_bytes(key, limit=MAX_INDEX)
    return assets


def run_config_changes(saved, cfg) -> list[str]:
    """`section.key: old -> new` for every setting that differs from the saved run_config.yaml (parsed)."""
    saved = saved if isinstance(saved, dict) else {}
    now = cfg.to_dict()
    changes = []
    for section, values in saved.items():
        if not isinstance(values, dict) or not isinstance(now.get(section), dict):
            continue
        for key, old in values.items():
            new = now[section].get(key, old)
            if new != old:
                changes.append(f"{section}.{key}: {brief(old)} -> {new!r}")
    return changes


def log_run_config_changes(store, name: str, cfg):
    """A resume reads the run_config.yaml it resumes from and names what this run changes."""
    key = f"{name}/{RUN_CONFIG}"
    if (dist.get_rank() if dist.is_initialized() else 0) != 0 or not store.exists(key):
        return
    changes = run_config_changes(read_yaml(store, key), cfg)
    if changes:
        log.info("settings changed since %s: %s", name, "; ".join(changes))
