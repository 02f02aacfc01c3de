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
- torch DCP reads `.metadata` with plain `pickle.load`, which would run code planted in a store.
  `check_metadata_pickle` unpickles it first with an allow-list of torch.distributed.checkpoint's
  metadata classes and refuses anything else, before megatron reads the (local, checked) copy.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import tempfile

import torch

from kubetron.checkpoint.layout import MARKER
from kubetron.contract.errors import CheckpointError, ConfigError

DIST = "dist"
OPTIM_PREFIX = "optimizer"
MEGATRON_CONFIG = MARKER  # megatron's own dist/metadata.json (its format and backend), written last as ours
MEGATRON_CHECKPOINT_VERSION = 3.0  # Megatron-LM's checkpoint_version, in dist/common.pt

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                    "torch.distributed.checkpoint.filesystem")
_ALLOWED_BUILTINS = {"set", "frozenset", "list", "dict", "tuple", "slice", "int", "float", "bool", "bytes", "str"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _ALLOWED_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # metadata dataclasses and enums, never a function
                return obj
        if module == "torch.serialization" and name == "_get_layout":
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def check_metadata_pickle(data: bytes, where: str):
    """Refuse a `.metadata` that references anything but torch DCP's metadata classes; return it."""
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any failure means: do not let pickle.load near it
        raise CheckpointError(f"{where}: refusing to load: {e}") from None


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
        marker = json.loads(store.read_bytes(f"{name}/{MARKER}"))
    except (ValueError, OSError):
        return None
    return marker.get("sharded_backend") if isinstance(marker, dict) else None


def _stage(store, prefix: str, staging: str):
    """Bring the dist_checkpointing files under `prefix` into `staging` (links on a path store, copies
    from S3) and return the checked `.metadata`. Only megatron's own files come along: its common.pt,
    which Megatron-LM fills with pickled objects (args), is never read."""
    keys = store.list(prefix)
    if f"{prefix}.metadata" not in keys:
        raise CheckpointError(f"{prefix}.metadata is missing")
    metadata = None
    for key in keys:
        rel = key[len(prefix):]
        if not (rel.endswith(".distcp") or rel in (".metadata", MEGATRON_CONFIG)):
            continue
        path = os.path.join(staging, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if rel == ".metadata":  # checked, then megatron reads this very copy
            data = store.read_bytes(key)
            metadata = check_metadata_pickle(data, key)
            with open(path, "wb") as dst:
                dst.write(data)
        elif store.local_path(key) is not None:  # a path store: link, do not copy the shards
            os.symlink(store.local_path(key), path)
        else:
            with store.open_read(key) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
    return metadata


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


def _saved_shapes(metadata) -> dict[str, tuple]:
    """{key: shape} of the model tensors in a torch DCP `.metadata` (no optimizer state, no objects)."""
    return {k: tuple(md.size) for k, md in metadata.state_dict_metadata.items()
            if k.startswith(_MODEL_PREFIXES) and hasattr(md, "size")}


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
    staging = _staging(cfg)
    try:
        metadata = _stage(store, prefix, staging)
        sd = _model_sharded(model)
        chunk = model[0]
        check_tensors(_wanted_shapes(sd), _saved_shapes(metadata), f"{store.url}/{name}",
                      first=chunk.pre_process, last=chunk.post_process)
        loaded = _load_sharded(sd, staging, prefix)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _into_model(model, loaded, prefix)


def load(model, optimizer, store, name: str, cfg, common: dict, *, with_optimizer: bool, device) -> dict | None:
    """Load model weights (and, with_optimizer, return optimizer state by parameter name, in the
    form canonical.load_optimizer_state_by_name takes) from `name`/dist."""
    prefix = f"{name}/{DIST}/"
    staging = _staging(cfg)
    try:
        _stage(store, prefix, staging)
        facts = common.get("dist_optimizer") if with_optimizer else None
        sd = {"model": _model_sharded(model)}
        keys = _param_keys(model, sd["model"])
        if facts:
            from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

            optim = {}
            for p in model[0].parameters():
                pname, sh = keys[id(p)]
                for k in facts["state_keys"]:
                    optim[f"{k}.{pname}"] = make_sharded_optimizer_tensor(
                        sh, torch.empty(p.shape, dtype=torch.float32, device=p.device), f"{OPTIM_PREFIX}.{k}")
            sd["optimizer"] = optim
        loaded = _load_sharded(sd, staging, prefix)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    chunk = model[0]
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
