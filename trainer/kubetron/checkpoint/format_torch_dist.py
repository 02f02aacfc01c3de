"""`checkpoint.ckpt_format: torch_dist`: model and optimizer state through megatron-core dist_checkpointing.

Layout inside a checkpoint directory (everything else is as in the default format):

    iter_0000020/dist/{.metadata, __<rank>_<n>.distcp, metadata.json, common.pt}   megatron-core torch_dist
    iter_0000020/{common.pt, rng/, run_config.yaml, <commit marker>}               kubetron, as always

`dist/` is a megatron-core `torch_dist` checkpoint of the sharded state dict
`{"model": model.sharded_state_dict(), "optimizer": {<key>: ...}, <Megatron-LM's common entries>}` (the
model's `_extra_state` objects included, so megatron's own `dist_checkpointing.load` of the model works at
its default strictness; dist/common.pt holds iteration, scheduler, FLOPs): every rank writes its own shards
(no gather onto rank 0; the DP replicas split what they hold in common, megatron's fully parallel
save), and megatron's ShardedTensor offsets let it load into another TP/PP/DP layout.
Optimizer state (Adam's `exp_avg`/`exp_avg_sq`, SGD's `momentum_buffer`, and the fp32 main weights
`main_param`) is saved as ShardedTensors that mirror each parameter's (`make_sharded_optimizer_tensor`,
key `optimizer.<state key>.<parameter key>`); the scalar `step` and the param groups go to kubetron's
common.pt.

`load_megatron` reads a checkpoint megatron-core wrote itself (Megatron-LM, Megatron Bridge: `iter_N/` is the
dist_checkpointing directory): its model tensors only, after `check_tensors` compared their global shapes
with this model's; megatron's common.pt (Megatron-LM pickles `args` there) is never read.

Three things around megatron-core 0.16.1:
- Its save hard-codes CUDA in two callbacks (`torch.cuda.synchronize()` after the device→host preload,
  a `torch.cuda.current_device()` flag tensor in the finalize); on CPU `_CPUSaveStrategy` overrides the
  one method that builds them. GPUs use megatron's default strategy unchanged.
- Its writer starts a spawn-mode multiprocessing manager, which re-imports `__main__`: a script that
  calls `pretrain()` with this format needs an `if __name__ == "__main__":` guard (the CLI has one).
- It writes to a filesystem only. On a path store (PVC) it writes straight into the transaction's
  directory (committed by the same marker protocol). For S3 each rank writes into a private staging
  directory (`checkpoint.dist_staging_dir`, default the system temp dir) and then uploads its files
  through the store's transaction; a load downloads `dist/` into staging first (on a path store the
  staging holds links to the shards, and a copy of `.metadata`). The S3 staging needs free local disk
  for one rank's shards (save) or the whole `dist/` (load).
- A store is hostile input, and torch DCP trusts its files: it reads `.metadata` with plain `pickle.load`,
  loads any entry recorded as bytes (`BytesStorageMetadata`) with `torch.load(weights_only=False)`, opens
  whatever relative path an entry names, and inflates compressed chunks. So megatron never sees the
  checkpoint's own `.metadata`: `check_metadata_pickle` unpickles it with an allow-list of DCP's metadata
  classes, `checked_metadata` takes from it only the tensors this load asks for, each a
  `TensorStorageMetadata` with this model's global shape, a known dtype, chunks that tile it, and bytes
  inside a `.distcp` file of this checkpoint (no transforms), and builds a fresh `Metadata` from those
  checked plain values, which is what the staging directory holds. Every chunk's bytes are a torch.save
  zip that layout.check_torch_zip accepts (DCP reads each with weights_only=True). An entry the load asks
  for that is anything but such a tensor is refused with one line: no byte or object entry is ever loaded.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import shutil
import tempfile

import torch

from kubetron.checkpoint.layout import MARKER, MAX_NDIM, TENSOR_DTYPES, brief, check_torch_zip, read_json
from kubetron.contract.errors import CheckpointError, ConfigError

DIST = "dist"
OPTIM_PREFIX = "optimizer"
MEGATRON_CONFIG = MARKER  # megatron's own dist/metadata.json (its format and backend), written last as ours
MEGATRON_CHECKPOINT_VERSION = 3.0  # Megatron-LM's checkpoint_version, in dist/common.pt

MAX_DCP_METADATA = 1 << 30  # bytes: torch DCP's .metadata (an entry per tensor chunk per saving rank)
DISTCP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}\.distcp")  # DCP's `__<rank>_<n>.distcp`
# the optimizer state kubetron's optimizers keep per parameter (Adam, SGD, fp32 mains): a checkpoint's
# `dist_optimizer.state_keys` may only name these
OPTIM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "main_param")

_DCP = "torch.distributed.checkpoint"
_ALLOWED_GLOBALS = frozenset(
    {(f"{_DCP}.metadata", n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                        "TensorProperties", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                        "_MEM_FORMAT_ENCODING")}
    # megatron-core keeps the save plans in the metadata too (all_local_plans)
    | {(f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}
    | {(f"{_DCP}.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"), ("torch", "Size"),
       ("collections", "OrderedDict")}
    # containers as protocols before 4 pickle them; never bytes/str (bytes(10**11) would be a memory bomb)
    | {("builtins", n) for n in ("set", "frozenset", "list", "dict", "tuple")})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:  # DCP's metadata dataclasses and enums, never a function
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def check_metadata_pickle(data: bytes, where: str):
    """Refuse a `.metadata` that references anything but torch DCP's metadata classes; return it (still
    hostile: checked_metadata takes the plain values out of it)."""
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any failure means: do not let pickle.load near it
        raise CheckpointError(f"{where}: refusing to load: {str(e)[:300]}") from None


def _ints(v, n: int | None = None) -> tuple[int, ...] | None:
    """`v` (a torch.Size or a tuple) as non-negative ints, `n` of them if given; None if it is not that."""
    if not isinstance(v, tuple) or len(v) > MAX_NDIM or (n is not None and len(v) != n):
        return None
    return tuple(v) if all(type(x) is int and x >= 0 for x in v) else None


def _checked_tensor(key: str, md, shape: tuple, where: str):
    """A fresh TensorStorageMetadata from the checked values of `md`, the entry for tensor `key` of `shape`."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    if type(md) is not TensorStorageMetadata:
        raise not_a_tensor(key, md, where)
    size = _ints(md.size)
    if size != tuple(shape):
        raise CheckpointError(f"{where}: {key} is {brief(md.size)} in the checkpoint, {list(shape)} here")
    props = md.properties
    if type(props) is not TensorProperties or props.dtype not in TENSOR_DTYPES.values():
        raise CheckpointError(f"{where}: {key} has no tensor dtype kubetron loads ({brief(props)})")
    chunks = [_checked_chunk(key, c, size, where) for c in (md.chunks if isinstance(md.chunks, list) else [None])]
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(size):
        raise CheckpointError(f"{where}: the chunks of {key} do not add up to its shape {list(size)}")
    return TensorStorageMetadata(properties=TensorProperties(dtype=props.dtype), size=torch.Size(size), chunks=chunks)


def _checked_chunk(key: str, c, size: tuple[int, ...], where: str):
    """A fresh ChunkStorageMetadata of `c`, a box inside `size`."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    off = _ints(c.offsets, len(size)) if type(c) is ChunkStorageMetadata else None
    n = _ints(c.sizes, len(size)) if off is not None else None
    if off is None or n is None or any(o + k > g for o, k, g in zip(off, n, size, strict=True)):
        raise CheckpointError(f"{where}: {key} has a chunk outside its shape {list(size)}")
    return ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(n))


def _storage_infos(raw, where: str) -> dict[tuple, object]:
    """{(fqn, chunk offsets): entry} of a DCP Metadata's storage_data (the entries still unchecked)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    data = getattr(raw, "storage_data", None)
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: no storage data")
    out = {}
    for k, info in data.items():
        off = () if type(k) is MetadataIndex and k.offset is None else _ints(getattr(k, "offset", None))
        if type(k) is MetadataIndex and isinstance(k.fqn, str) and off is not None:
            out[(k.fqn, off)] = info
    return out


def _checked_storage(key: str, offsets, info, files: dict[str, int], where: str):
    """A fresh _StorageInfo from `info`: a whole .distcp file of this checkpoint holds the bytes, untransformed."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    ok = type(info) is _StorageInfo and isinstance(info.relative_path, str) and info.relative_path in files \
        and type(info.offset) is int and type(info.length) is int and not getattr(info, "transform_descriptors", None)
    if not ok or not 0 <= info.offset <= info.offset + info.length <= files[info.relative_path]:
        at = ", ".join(brief(getattr(info, a, None)) for a in ("relative_path", "offset", "length"))
        raise CheckpointError(f"{where}: the bytes of {key} at {list(offsets)} ({at}: file, offset, length) are "
                              "not inside a .distcp file of this checkpoint")
    return _StorageInfo(relative_path=info.relative_path, offset=info.offset, length=info.length)


def checked_tensors(raw, wanted: dict[str, tuple], where: str) -> dict:
    """{key: fresh TensorStorageMetadata} for the tensors a load asks for (`wanted`: key -> global shape)."""
    from torch.distributed.checkpoint.metadata import Metadata

    if type(raw) is not Metadata or not isinstance(raw.state_dict_metadata, dict):
        raise CheckpointError(f"{where}: not torch DCP metadata ({type(raw).__name__})")
    return {k: _checked_tensor(k, raw.state_dict_metadata.get(k), shape, where) for k, shape in wanted.items()}


def checked_metadata(raw, tensors: dict, files: dict[str, int], where: str):
    """A fresh DCP Metadata of `tensors` (checked_tensors') whose bytes `raw`'s storage data places inside
    `files` ({.distcp name: size}); nothing else of `raw` is kept."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    infos = _storage_infos(raw, where)
    storage = {MetadataIndex(k, c.offsets, i): _checked_storage(k, c.offsets, infos.get((k, tuple(c.offsets))),
                                                                files, where)
               for k, md in tensors.items() for i, c in enumerate(md.chunks)}
    return Metadata(state_dict_metadata=dict(tensors), storage_data=storage)


def referenced_files(raw, tensors: dict, names: set[str], where: str) -> set[str]:
    """The .distcp files (of `names`, those the checkpoint holds) that the chunks of `tensors` name."""
    infos = _storage_infos(raw, where)
    out = set()
    for k, md in tensors.items():
        for c in md.chunks:
            rel = getattr(infos.get((k, tuple(c.offsets))), "relative_path", None)
            if not (isinstance(rel, str) and DISTCP_NAME.fullmatch(rel) and rel in names):
                raise CheckpointError(f"{where}: {k} names {brief(rel)}, not a .distcp file of this checkpoint")
            out.add(rel)
    return out


def cpu_save_strategy():
    """megatron's torch_dist save strategy without its two CUDA calls (see the module docstring)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.utils import _get_failure_dict

    class _CPUSaveStrategy(TorchDistSaveShardedStrategy):
        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
            save_fn, _preload_fn, save_args = writer.get_save_function_and_args()

            def finalize_fn():  # state_dict_saver.save_state_dict_async_finalize with a CPU flag tensor
                storage_writer, global_metadata, dist_wrapper = save_state_dict_ret
                results = dist_wrapper.gather_object(storage_writer.retrieve_write_results())
                failures = {}
                if dist_wrapper.is_coordinator:
                    failures = _get_failure_dict(results)
                    if not failures:
                        storage_writer.finish(global_metadata, results)
                flag = torch.tensor([int(len(failures) > 0)], dtype=torch.int)
                torch.distributed.broadcast(flag, src=dist_wrapper.coordinator_rank, group=dist_wrapper.group)
                if flag.item():
                    raise CheckpointException("write", failures)

            # no preload: the tensors are on the host already (prepare_write_data cloned views)
            return AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=None)

    return _CPUSaveStrategy("torch_dist", 1)


def _save_strategy(on_gpu: bool):
    """torch_dist, fully parallel over the data-parallel group: the DP replicas split the writing of
    what they all hold, instead of DP rank 0 writing everything (megatron's fully_parallel_save)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    base = get_default_save_sharded_strategy() if on_gpu else cpu_save_strategy()
    if parallel_state.get_data_parallel_world_size() == 1:
        return base
    return FullyParallelSaveStrategyWrapper(base, parallel_state.get_data_parallel_group())


def _model_sharded(model, *, objects: bool = False) -> dict:
    """The model's sharded state dict: tensors (and factories); with objects also the `_extra_state`
    ShardedObjects, which a save writes so that megatron's own load of the model finds every key it asks
    for. A load never asks for them (TransformerEngine's are pickled FP8 metadata)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    kinds = (ShardedTensor, ShardedTensorFactory, ShardedObject) if objects else (ShardedTensor, ShardedTensorFactory)
    return {k: v for k, v in model[0].sharded_state_dict().items() if isinstance(v, kinds)}


def _param_keys(model, model_sd: dict) -> dict[int, tuple[str, object]]:
    """id(parameter) -> (local parameter name, its sharded tensor/factory)."""
    by_id = {id(v.data): (k, v) for k, v in model_sd.items()}
    return {id(p): (n, by_id[id(p)][1]) for n, p in model[0].named_parameters() if id(p) in by_id}


def sharded_state_dict(model, optimizer, *, with_optimizer: bool) -> tuple[dict, dict]:
    """(sharded state dict to save, facts for common.pt). Collective with the distributed optimizer."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model_sd = _model_sharded(model, objects=True)
    out = {"model": model_sd}
    facts = {}
    if with_optimizer:
        keys = _param_keys(model, model_sd)
        optim, state_keys, step = {}, set(), None
        for p, s in optimizer.state.items():
            name, sh = keys[id(p)]
            for k, v in s.items():
                if torch.is_tensor(v) and v.ndim > 0 and tuple(v.shape) == tuple(p.shape):
                    optim[f"{k}.{name}"] = make_sharded_optimizer_tensor(sh, v.detach(), f"{OPTIM_PREFIX}.{k}")
                    state_keys.add(k)
                elif k == "step":
                    step = v
        out["optimizer"] = optim
        facts = {"state_keys": sorted(state_keys), "step": step.detach().cpu() if torch.is_tensor(step) else step,
                 "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
    return out, facts


def _staging(cfg) -> str:
    base = cfg.checkpoint.dist_staging_dir
    if base:
        os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="kubetron-dist-", dir=base or None)


def megatron_common(iteration: int, scheduler: dict, train_state: dict) -> dict:
    """What Megatron-LM / Bridge keep in a torch_dist checkpoint's common.pt, in their names, so that
    megatron's own load of dist/ returns the iteration and the LR schedule (plain data only)."""
    return {"checkpoint_version": MEGATRON_CHECKPOINT_VERSION, "iteration": iteration,
            "opt_param_scheduler": {"max_lr": scheduler["max_lr"], "min_lr": scheduler["min_lr"],
                                    "lr_warmup_steps": scheduler["warmup_steps"],
                                    "lr_decay_steps": scheduler["decay_steps"],
                                    "lr_decay_style": scheduler["style"], "num_steps": scheduler["num_steps"]},
            "num_floating_point_operations_so_far": train_state["floating_point_operations_so_far"],
            "train_state": train_state}


def save(model, optimizer, txn, cfg, *, with_optimizer: bool, common: dict) -> dict:
    """Collective: write this rank's shards into `txn` under dist/, and `common` (the same on every rank)
    into dist/common.pt. Returns facts for kubetron's common.pt."""
    from megatron.core import dist_checkpointing

    sd, facts = sharded_state_dict(model, optimizer, with_optimizer=with_optimizer)
    sd.update(common)
    strategy = _save_strategy(on_gpu=any(p.is_cuda for p in model[0].parameters()))
    direct = txn.local_dir(DIST)
    if direct is not None:  # a path store (PVC): megatron writes into the transaction's directory
        dist_checkpointing.save(sd, direct, sharded_strategy=strategy)
        return facts
    staging = _staging(cfg)
    try:
        dist_checkpointing.save(sd, staging, sharded_strategy=strategy)
        for root, _, files in os.walk(staging):
            for f in sorted(files):
                rel = os.path.relpath(os.path.join(root, f), staging)
                with open(os.path.join(root, f), "rb") as src, txn.open_write(f"{DIST}/{rel}") as dst:
                    shutil.copyfileobj(src, dst, 8 << 20)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return facts


def is_dist_checkpoint(store, name: str) -> bool:
    return store.exists(f"{name}/{DIST}/{MEGATRON_CONFIG}")


def megatron_backend(store, name: str) -> str | None:
    """The `sharded_backend` of a checkpoint written by megatron-core itself (Megatron-LM, Megatron Bridge:
    the iteration directory is the dist_checkpointing directory, its metadata.json megatron's config),
    or None for kubetron's own layout (there metadata.json is kubetron's commit marker)."""
    try:
        marker = read_json(store, f"{name}/{MARKER}")
    except FileNotFoundError:
        return None
    return marker.get("sharded_backend") if isinstance(marker, dict) else None


def _read_metadata(store, prefix: str):
    """The checkpoint's own `.metadata`, unpickled with the allow-list (still to be checked)."""
    key = f"{prefix}.metadata"
    try:
        return check_metadata_pickle(store.read_bytes(key, limit=MAX_DCP_METADATA), key)
    except FileNotFoundError:
        raise CheckpointError(f"{key} is missing") from None


def _megatron_config(store, prefix: str) -> bytes:
    """megatron's dist_checkpointing config (metadata.json) as staged: rewritten from its checked values."""
    key = f"{prefix}{MEGATRON_CONFIG}"
    try:
        config = read_json(store, key)
    except FileNotFoundError:
        raise CheckpointError(f"{key} is missing") from None
    version = config.get("sharded_backend_version") if isinstance(config, dict) else None
    if not isinstance(config, dict) or config.get("sharded_backend") != "torch_dist" or type(version) is not int:
        raise CheckpointError(f"{store.url}/{key}: not a megatron-core torch_dist checkpoint ({brief(config)})")
    return json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": version,
                       "common_backend": "torch", "common_backend_version": 1}).encode()


def _stage_file(store, key: str, path: str) -> int:
    """`key` at the staging `path`: on a path store a link to its file (which the store checked is a regular
    file reached without following a link; a file swapped for a link after that check is still read only
    as a torch.save zip, weights_only), from S3 a copy. Returns its size."""
    local = store.local_path(key)
    if local is not None:
        os.symlink(local, path)
    else:
        with store.open_read(key) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
    return os.path.getsize(path)


def _check_chunks(staging: str, metadata, where: str):
    """Every chunk DCP will torch.load is a torch.save zip that check_torch_zip accepts (nothing inflates)."""
    by_file: dict[str, list] = {}
    for info in metadata.storage_data.values():
        by_file.setdefault(info.relative_path, []).append(info)
    for rel, infos in by_file.items():
        with open(os.path.join(staging, rel), "rb") as f:
            for info in infos:
                check_torch_zip(f, f"{where}{rel} bytes {info.offset}+{info.length}", info.offset, info.length)


def _stage(store, prefix: str, staging: str, raw, tensors: dict):
    """Into `staging`, what megatron reads: the .distcp files the checked tensors' chunks name, a fresh
    `.metadata` of only those tensors (checked_metadata) and megatron's config. Nothing else comes along:
    megatron's common.pt, which Megatron-LM fills with pickled objects (args), is never read."""
    names = {k[len(prefix):] for k in store.list(prefix)}
    files = {rel: _stage_file(store, prefix + rel, os.path.join(staging, rel))
             for rel in sorted(referenced_files(raw, tensors, names, prefix))}
    metadata = checked_metadata(raw, tensors, files, prefix)
    _check_chunks(staging, metadata, prefix)
    with open(os.path.join(staging, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)  # built here from checked plain values, nothing of the checkpoint's pickle
    with open(os.path.join(staging, MEGATRON_CONFIG), "wb") as f:
        f.write(_megatron_config(store, prefix))


def _load_checked(sd: dict, store, prefix: str, raw, wanted: dict[str, tuple], cfg) -> dict:
    """megatron's dist_checkpointing.load of `sd` from a staging directory that holds only the tensors
    `wanted` asks for (key -> global shape), checked."""
    tensors = checked_tensors(raw, wanted, prefix)
    staging = _staging(cfg)
    try:
        _stage(store, prefix, staging, raw, tensors)
        return _load_sharded(sd, staging, prefix)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _no_common_strategy():
    """megatron's common-state loader with nothing to load: kubetron reads the weights (and its own
    common.pt, weights_only) itself, and a load never unpickles megatron's common.pt."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class _NoCommon(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return {}

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise CheckpointError(f"{checkpoint_dir}: kubetron loads no sharded objects")

    return _NoCommon()


# --- the architecture, from the tensors the checkpoint holds ------------------------------------------

_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
# model.<field> a tensor that only one side has points at (first match)
_PRESENCE_FIELDS = (("mlp.router.", "num_moe_experts"), ("mlp.experts.", "num_moe_experts"),
                    ("mlp.shared_experts.", "moe_shared_expert_intermediate_size"),
                    ("output_layer.", "share_embeddings_and_output_weights"),
                    ("position_embeddings", "position_embedding_type"),
                    ("layer_norm_bias", "normalization"), ("layernorm.bias", "normalization"),
                    ("q_layernorm", "qk_layernorm"), ("k_layernorm", "qk_layernorm"),
                    ("linear_qkv.bias", "add_qkv_bias"), (".bias", "add_bias_linear"))


def _wanted_shapes(sd: dict) -> dict[str, tuple]:
    """{checkpoint key: global shape} of the tensors a sharded state dict asks for (factories built)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for v in sd.values():
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            for t in built.values() if isinstance(built, dict) else built:
                out[t.key] = tuple(t.global_shape)
        elif isinstance(v, ShardedTensor):
            out[v.key] = tuple(v.global_shape)
    return out


def not_a_tensor(key: str, md, where: str) -> CheckpointError:
    what = "it is missing" if md is None else f"a {type(md).__name__} entry is no tensor (DCP would unpickle it)"
    return CheckpointError(f"{where}: refusing to load {key}: {what}")


def _saved_shapes(metadata, wanted: dict, where: str) -> dict[str, tuple]:
    """{key: shape} of the model tensors in a torch DCP `.metadata` (no optimizer state, no objects); an
    entry the load asks for (`wanted`) that is not a tensor is refused here."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise CheckpointError(f"{where}: not torch DCP metadata")
    out = {}
    for k, md in entries.items():
        if isinstance(k, str) and k.startswith(_MODEL_PREFIXES):
            size = _ints(md.size) if type(md) is TensorStorageMetadata else None
            if size is not None:
                out[k] = size
            elif k in wanted:
                raise not_a_tensor(k, md, where)
    return out


def _shape_field(key: str, saved: tuple, wanted: tuple) -> str:
    if key.startswith("decoder.layers.") and saved[:1] != wanted[:1]:
        return "num_layers"  # the layers are stacked on a leading axis
    if "word_embeddings" in key or key.startswith("output_layer."):
        return "vocab_size" if saved[0] != wanted[0] else "hidden_size"
    if "position_embeddings" in key:
        return "max_position_embeddings" if saved[0] != wanted[0] else "hidden_size"
    if "mlp.router." in key:
        return "num_moe_experts"
    if "mlp.shared_experts." in key:
        return "moe_shared_expert_intermediate_size"
    if "mlp.experts." in key:  # megatron stacks the experts on leading axes, each a matrix
        return "num_moe_experts" if saved[:-2] != wanted[:-2] else "moe_ffn_hidden_size"
    if "linear_fc1" in key or "linear_fc2" in key:
        return "ffn_hidden_size"
    if "linear_qkv" in key and saved[-1:] == wanted[-1:]:
        return "num_query_groups"
    return "hidden_size"


def _on_stage(key: str, first: bool, last: bool) -> bool:
    """Whether a pipeline stage's chunk would hold `key` (every stage holds the stacked decoder layers)."""
    if key.startswith("embedding."):
        return first
    if key.startswith(("output_layer.", "decoder.final_layernorm.")):
        return last
    return True


def check_tensors(wanted: dict[str, tuple], saved: dict[str, tuple], where: str, *, first: bool = True,
                  last: bool = True):
    """This stage's tensors (`first`/`last`: pipeline stage) against the checkpoint's, as a one-line ConfigError
    naming the first model.<field> that explains a difference (a tensor only one side has, or another global
    shape); `model` alone where no field does."""
    only_saved = {k for k in saved.keys() - wanted.keys() if _on_stage(k, first, last)}
    one_side = [(next((f"model.{f}" for part, f in _PRESENCE_FIELDS if part in key), "model"), key)
                for key in sorted((wanted.keys() - saved.keys()) | only_saved)]
    if one_side:  # a key a field explains first
        field, key = min(one_side, key=lambda fk: fk[0] == "model")
        side = "this model has" if key in wanted else "only the checkpoint has"
        raise ConfigError(field, f"{where} does not match this model: {side} {key}")
    for key in sorted(wanted):
        if wanted[key] != saved[key]:
            raise ConfigError(f"model.{_shape_field(key, saved[key], wanted[key])}",
                              f"{where} does not match this model: {key} is {list(saved[key])} in the "
                              f"checkpoint, {list(wanted[key])} here")


# --- loading ---------------------------------------------------------------------------------------

def _load_sharded(sd: dict, staging: str, prefix: str) -> dict:
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(sd, staging, common_strategy=_no_common_strategy())
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - megatron raises many kinds; name the checkpoint
        raise CheckpointError(f"{prefix}: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None


def _into_model(model, weights: dict, prefix: str):
    missing, unexpected = model[0].load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{prefix} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def load_megatron(model, store, name: str, cfg):
    """Weights from a torch_dist checkpoint that megatron-core wrote (Megatron-LM, Megatron Bridge, or
    `dist_checkpointing.save(model.sharded_state_dict(), dir)`): the tensors only, checked against this
    model first. Its common.pt (args, scheduler) and optimizer state are not read."""
    prefix = f"{name}/"
    sd = _model_sharded(model)
    wanted = _wanted_shapes(sd)
    raw = _read_metadata(store, prefix)
    chunk = model[0]
    check_tensors(wanted, _saved_shapes(raw, wanted, prefix), f"{store.url}/{name}",
                  first=chunk.pre_process, last=chunk.post_process)
    _into_model(model, _load_checked(sd, store, prefix, raw, wanted, cfg), prefix)


def _optimizer_facts(common: dict, where: str) -> dict | None:
    """kubetron's common.pt record of a torch_dist optimizer state, checked: it decides what is allocated."""
    facts = common.get("dist_optimizer")
    if not facts:
        return None
    keys = facts.get("state_keys") if isinstance(facts, dict) else None
    if not (isinstance(keys, list) and all(k in OPTIM_STATE_KEYS for k in keys) and len(set(keys)) == len(keys)
            and isinstance(facts.get("param_groups"), list)):
        raise CheckpointError(f"{where}: dist_optimizer names {brief(keys)}, not an optimizer state kubetron wrote")
    return facts


def load(model, optimizer, store, name: str, cfg, common: dict, *, with_optimizer: bool, device) -> dict | None:
    """Load model weights (and, with_optimizer, return optimizer state by parameter name, in the
    form canonical.load_optimizer_state_by_name takes) from `name`/dist."""
    prefix = f"{name}/{DIST}/"
    facts = _optimizer_facts(common, prefix) if with_optimizer else None
    sd = {"model": _model_sharded(model)}
    keys = _param_keys(model, sd["model"])
    if facts:
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        optim = {}
        for p in model[0].parameters():
            pname, sh = keys[id(p)]
            for k in facts["state_keys"]:
                optim[f"{k}.{pname}"] = make_sharded_optimizer_tensor(
                    sh, torch.zeros(p.shape, dtype=torch.float32, device=p.device), f"{OPTIM_PREFIX}.{k}")
        sd["optimizer"] = optim
    model_keys = _wanted_shapes(sd["model"])
    wanted = {**model_keys, **_wanted_shapes(sd.get("optimizer", {}))}
    raw = _read_metadata(store, prefix)
    chunk = model[0]
    check_tensors(model_keys, _saved_shapes(raw, wanted, prefix), f"{store.url}/{name}",
                  first=chunk.pre_process, last=chunk.post_process)
    loaded = _load_checked(sd, store, prefix, raw, wanted, cfg)
    _into_model(model, loaded["model"], prefix)
    if not facts:
        return None
    state = {}
    for pname, _ in chunk.named_parameters():
        entry = {k: loaded["optimizer"][f"{k}.{pname}"].to(device) for k in facts["state_keys"]}
        if facts["step"] is not None and any(k != "main_param" for k in entry):
            entry["step"] = facts["step"].clone() if torch.is_tensor(facts["step"]) else facts["step"]
        state[pname] = entry
    return {"state": state, "param_groups": facts["param_groups"]}
