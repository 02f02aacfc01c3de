"""Reading and writing: HF directories (config.json + safetensors) and kubetron checkpoints.

`import_hf` writes a checkpoint that kubetron/checkpoint/ reads (`iter_0000000/{shards/, common.pt,
run_config.yaml, tokenizer/}` + `metadata.json`, the commit marker, written last through the store's
transaction) in the `sharded` format, so `checkpoint.pretrained_checkpoint=OUT` loads it at any TP/PP with
every rank reading only its part. It holds weights only: `finetune` starts from it; it is not a run to resume.
Every header of the HF files is checked before the first byte is written, so a bad input leaves nothing
behind; the tensors are then read, converted and written one at a time (kubetron.hf.weights).

`export_hf` writes `model.safetensors`, or shards of at most `max_shard_size` bytes with
`model.safetensors.index.json` as transformers' `save_pretrained` does, one shard in memory at a time, with a
progress line per shard; then the tokenizer files the checkpoint holds (its chat template included) and
config.json, last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

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
from kubetron.compat import megatron_core
from kubetron.contract.errors import CheckpointError, ConfigError
from kubetron.contract.times import stamp
from kubetron.data.tokenizer import CHAT_TEMPLATE_DIR  # transformers' named templates: <name>.jinja
from kubetron.hf import config_map, convert, generation, weights
from kubetron.hf.safetensors_io import write_file, write_files

if TYPE_CHECKING:
    from kubetron.storage import Store

# HF tokenizer files carried along (import: into the checkpoint; export: back out of it), as transformers
# writes them: the chat template in chat_template.jinja (transformers >= 4.43) or chat_template.json, or
# inside tokenizer_config.json (older).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja", "chat_template.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default, "5GB"
_MOE_TRAINING_KEYS = ("moe_router_load_balancing_type", "moe_aux_loss_coeff")  # carried and printed; no architecture
_UNSET_IS_DEFAULT = ("sliding_window", "kv_channels", "moe_shared_expert_intermediate_size")  # not printed when null
Progress = Callable[[str], None]


def _model_keys(hf_dir: str) -> dict:
    """The full `model:` section (defaults filled in) for an HF directory."""
    from kubetron.contract.config import GPTModelConfig

    return GPTModelConfig(**config_map.model_section(config_map.read_hf_config(hf_dir))).model_dump()


def open_hf(hf_dir: str) -> tuple[dict, weights.HFWeights]:
    """(model keys, its canonical tensors read on access) of an HF directory; every file's header checked."""
    m = _model_keys(hf_dir)
    return m, weights.HFWeights(hf_dir, m)


def load_hf_canonical(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(model keys, canonical tensors) of an HF directory, all in memory (tools and tests)."""
    m, source = open_hf(hf_dir)
    with source:
        return m, dict(source.items())


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


class _Streamed(NamedTuple):
    """A rank's part of a sharded checkpoint whose pieces are made as they are written (format_sharded.write)."""

    pieces: Iterator
    values: dict


def _pieces(source: weights.Source, progress: Progress | None) -> Iterator:
    """format_sharded pieces of every tensor of `source`, whole, read one at a time."""
    from kubetron.checkpoint.format_sharded import Piece

    total = max(sum(source.nbytes(n) for n in source), 1)
    done, reported = 0, 0
    for name in source:
        t = source[name]
        if ".linear_fc1." in name:  # the sharded format keeps a gated fc1 as (2, ffn, ...) = [gate, up]
            t = t.view(2, t.shape[0] // 2, *t.shape[1:])
        yield Piece(f"model/{name}", tuple(t.shape), [(0, n) for n in t.shape], t)
        done += source.nbytes(name)
        if progress is not None and done * 10 // total > reported:  # a line per tenth
            reported = done * 10 // total
            progress(f"import-hf: {100 * done // total}% converted ({done / 1e6:,.1f} of {total / 1e6:,.1f} MB)")


def import_hf(hf_dir: str, out: str, progress: Progress | None = None) -> dict:
    """Write `out`/iter_0000000 from the HF model in `hf_dir`; returns the model keys."""
    if not os.path.isdir(hf_dir):
        raise ConfigError("HF_DIR", f"{hf_dir}: no such directory")
    m, source = open_hf(hf_dir)  # every check before megatron-core is even imported
    with source:
        _write_import(hf_dir, out, m, source, progress)
    return m


def hf_tokenizer_files(hf_dir: str) -> list[str]:
    """The tokenizer files of an HF directory (names relative to it, regular files only)."""
    named = os.path.join(hf_dir, CHAT_TEMPLATE_DIR)
    extra = [f"{CHAT_TEMPLATE_DIR}/{n}" for n in sorted(os.listdir(named)) if n.endswith(".jinja")] \
        if os.path.isdir(named) else []
    return [f for f in (*TOKENIZER_FILES, *extra) if os.path.isfile(os.path.join(hf_dir, f))
            and not os.path.islink(os.path.join(hf_dir, f))]


def _write_import(hf_dir: str, out: str, m: dict, source: weights.Source, progress: Progress | None) -> None:
    megatron_core.install()  # megatron-core imported the trainer's way (without its TE/Apex notices)
    from kubetron.checkpoint import format_sharded
    from kubetron.contract.config import GPTModelConfig
    from kubetron.storage import open_store

    store = open_store(out)
    if committed_iterations(store):
        raise ConfigError("OUT", f"{out} already holds a checkpoint; give an empty or new directory")
    common = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, "ckpt_format": "sharded", "num_shards": 1,
              "model_config": arch_record(GPTModelConfig(**m)), "source": {"hf_dir": os.path.abspath(hf_dir)},
              "hf": generation.record_of_hf_dir(hf_dir)}
    name = iter_dir(0)
    txn = store.begin_dir(name, txn_id="import-hf")
    try:
        format_sharded.write(txn, 0, _Streamed(_pieces(source, progress), {}))
        txn.write_bytes(COMMON, to_bytes(common))
        txn.write_bytes(RUN_CONFIG, yaml.safe_dump({"model": m}, sort_keys=False).encode())
        for f in hf_tokenizer_files(hf_dir):
            with open(os.path.join(hf_dir, f), "rb") as fh:
                txn.write_bytes(f"{TOKENIZER_DIR}/{f}", fh.read())
        marker = {"iteration": 0, "time": stamp(), "run_id": "import-hf",
                  "checkpoint_version": CHECKPOINT_VERSION, "world_size": 1}
        txn.commit(json.dumps(marker).encode())
    except BaseException:
        txn.abort()
        raise
    assert store.exists(f"{name}/{MARKER}")


def _resolve(location: str) -> tuple[Store, str]:
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


def open_checkpoint(location: str) -> tuple[dict, weights.Source, Store, str]:
    """(model keys, its canonical tensors read on access, store, iter dir) of a kubetron checkpoint (newest
    iteration): the `sharded` format one tensor at a time, the `kubetron` format's model.pt whole."""
    megatron_core.install()  # megatron-core imported the trainer's way (without its TE/Apex notices)
    from kubetron.checkpoint import format_kubetron

    store, name = _resolve(location)
    run_cfg = yaml.safe_load(store.read_bytes(f"{name}/{RUN_CONFIG}"))
    model_pt = f"{name}/{format_kubetron.MODEL}"
    if store.exists(model_pt):  # ckpt_format kubetron (and import-hf's output before the sharded format)
        with store.open_read(model_pt) as f:
            return run_cfg["model"], weights.InMemory(safe_load(f, model_pt)), store, name
    common = _common(store, name)
    if common.get("ckpt_format") != "sharded":
        raise ConfigError("CKPT", f"{location}/{name}: export-hf reads checkpoints saved with "
                                  "checkpoint.ckpt_format sharded or kubetron, not torch_dist")
    return run_cfg["model"], weights.Sharded(store, name, common["num_shards"]), store, name


def read_checkpoint(location: str) -> tuple[dict, dict[str, torch.Tensor], object, str]:
    """(model keys, canonical tensors, store, iter dir) of a kubetron checkpoint (newest iteration), in memory."""
    m, source, store, name = open_checkpoint(location)
    with source:
        return m, dict(source.items()), store, name


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


def _read_base(location: str | None) -> weights.Source:
    """Canonical tensors of a LoRA checkpoint's base (a kubetron checkpoint or an HF directory), read on access."""
    from kubetron.hf import is_hf_dir

    if not location:
        raise ConfigError("CKPT", "the LoRA checkpoint names no pretrained_checkpoint to merge into")
    return open_hf(location)[1] if is_hf_dir(location) else open_checkpoint(location)[1]


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


def export_hf(location: str, out: str, adapter_only: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
              progress: Progress | None = None) -> dict:
    """Write `out`/{config.json, generation_config.json, model.safetensors or its shards + index, tokenizer
    files} from a kubetron checkpoint. A LoRA checkpoint's adapters are merged into its base; with
    `adapter_only`, `out` gets a PEFT adapter naming the base's HF directory, and the tokenizer files."""
    m, source, store, name = open_checkpoint(location)
    with source:
        return _export(location, out, (m, source, store, name), adapter_only, max_shard_size, progress)


def _export(location: str, out: str, ckpt: tuple, adapter_only: bool, max_shard_size: int,
            progress: Progress | None) -> dict:
    from kubetron.hf import lora

    m, source, store, name = ckpt
    common = _common(store, name)
    info = common.get("peft")
    if adapter_only and info is None:
        raise ConfigError("--adapter-only", f"{location}/{name} is not a LoRA (peft) checkpoint")
    if info is not None:
        pairs = lora.adapters(source)
        if adapter_only:
            files = {k: v for k, v in _tokenizer_files(store, name).items() if k != generation.GENERATION_CONFIG}
            return lora.write_peft(out, pairs, info, m, peft_base_name(info.get("pretrained_checkpoint")), files)
        base = _read_base(info.get("pretrained_checkpoint"))
        with weights.Merged(base, pairs, info["alpha"] / info["dim"]) as merged:
            return _export_model(out, m, merged, (store, name, common.get("hf")), max_shard_size, progress)
    return _export_model(out, m, source, (store, name, common.get("hf")), max_shard_size, progress)


def _export_model(out: str, m: dict, source: weights.Source, where: tuple, max_shard_size: int,
                  progress: Progress | None) -> dict:
    store, name, record = where
    cfg = config_map.hf_config(m)
    missing = [u.canonical for u in convert.units(m) if u.canonical not in source]
    if missing:
        raise ConfigError("CKPT", f"{store.url}/{name}: tensor {missing[0]!r} missing for this model")
    dtypes = {str(source.spec(u.canonical)[1]).removeprefix("torch.") for u in convert.units(m)}
    cfg["torch_dtype"] = cfg["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    files = _export_files(store, name, record, cfg)
    _check_out(out, "config.json")
    write_weights(out, source, m, max_shard_size, progress)
    write_files(out, files)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:  # last: marks a complete export
        json.dump(cfg, f, indent=2)
    return cfg


def _check_out(out: str, marker: str) -> None:
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, marker)):
        raise ConfigError("OUT", f"{out} already holds a {marker}; give an empty or new directory")


def shard_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of consecutive tensors per shard: a shard holds at most `limit` bytes, or one larger tensor."""
    groups: list[list[int]] = []
    size = 0
    for i, n in enumerate(sizes):
        if not groups or (size + n > limit and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def write_weights(out: str, source: weights.Source, m: dict, max_shard_size: int,
                  progress: Progress | None = None) -> list[str]:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` when the
    weights exceed `max_shard_size` bytes: one shard's tensors in memory at a time. Returns the file names."""
    units = convert.units(m)
    groups = shard_groups([source.nbytes(u.canonical) for u in units], max_shard_size)
    names = [weights.SINGLE] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for i, (file, group) in enumerate(zip(names, groups, strict=True)):
        tensors: dict[str, torch.Tensor] = {}
        for u in (units[j] for j in group):
            tensors.update(zip(u.hf, convert.to_hf(u, source[u.canonical], m), strict=True))
        size = write_file(os.path.join(out, file), tensors)
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        if progress is not None:
            progress(f"export-hf: wrote {file} ({i + 1} of {len(groups)}, {size / 1e6:,.1f} MB)")
    if len(groups) > 1:
        with open(os.path.join(out, weights.INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


def _tokenizer_files(store, name: str) -> dict[str, bytes]:
    """The tokenizer files a checkpoint holds (iter_N/tokenizer/, as transformers wrote them: the chat template
    in chat_template.jinja or .json or tokenizer_config.json, named ones in additional_chat_templates/),
    verbatim, by their names relative to tokenizer/."""
    prefix = f"{name}/{TOKENIZER_DIR}/"
    return {k[len(prefix):]: store.read_bytes(k) for k in store.list(prefix.rstrip("/")) if k.startswith(prefix)}


def _export_files(store, name: str, record: dict | None, cfg: dict) -> dict[str, bytes]:
    """The tokenizer files the checkpoint holds and generation_config.json; the special ids go into `cfg`:
    the HF base's (`record`), else (a model trained from scratch) the tokenizer's."""
    files = _tokenizer_files(store, name)
    ids, gen = generation.export_ids(record, None if record else _run_tokenizer(store, name, files))
    cfg.update(ids)
    if gen:  # else an older import's copy in tokenizer/, if any
        files[generation.GENERATION_CONFIG] = json.dumps(gen, indent=2).encode()
    return files


def check_hf_dir(cfg, hf_dir: str) -> None:
    """An HF directory as checkpoint.pretrained_checkpoint: its config.json must give this run's model (a
    config error, exit 2, naming the first field that differs). Reads config.json only."""
    from kubetron.contract.config import GPTModelConfig

    hf_model = GPTModelConfig(**config_map.model_section(config_map.read_hf_config(hf_dir)))
    diffs = [f"model.{k}: HF {arch_value(hf_model, k)!r}, this run {arch_value(cfg.model, k)!r}" for k in HF_ARCH_FIELDS
             if arch_value(hf_model, k) != arch_value(cfg.model, k)]
    if diffs:
        raise ConfigError(diffs[0].split(":")[0], f"{hf_dir} does not match this model (`kubetron import-hf` prints "
                                                  "the model section): " + "; ".join(diffs[:4]))


def load_hf_into_model(model, cfg, hf_dir: str, keep=None):
    """checkpoint.pretrained_checkpoint = an HF directory: its weights into this rank's model parts
    (`keep(name)`: only some; LoRA: the base), read tensor by tensor."""
    from kubetron.checkpoint import canonical

    check_hf_dir(cfg, hf_dir)
    _, source = open_hf(hf_dir)
    with source:
        canonical.load_model_state(model, source, keep=keep)
