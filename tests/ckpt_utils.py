"""Shared helpers for the checkpoint tests that run megatron-core in this process: kubetron's parts built as
`kubetron train` builds them, megatron-core's own GPTModel, and checkpoints written as Megatron-LM and Megatron
Bridge write them."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tests.hf_utils import config_for
from tests.inprocess import ensure_world_of_one

# a Llama-like model section (RMSNorm, SwiGLU, GQA, untied output, RoPE, no biases)
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
             vocab_size=128, seq_length=32, max_position_embeddings=32, position_embedding_type="rope",
             normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
             share_embeddings_and_output_weights=False, transformer_impl="local")


class Payload:
    """Runs code (creates a file) if anything unpickles it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def megatron_gpt(seed: int):
    """megatron-core's own GPTModel with its own local layer spec, configured by hand to match MODEL; every
    parameter random (the norms too, so nothing loads right by accident)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ensure_world_of_one()
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=96, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
                               bias_activation_fusion=False, persist_layer_norm=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=128, max_sequence_length=32, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def assert_bit_exact(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def megatron_save(state: dict, directory: Path):
    """megatron-core's dist_checkpointing.save (torch_dist), with the CPU save strategy kubetron uses (megatron's
    default strategy calls torch.cuda.synchronize(); the files it writes are the same)."""
    from kubetron.checkpoint.format_torch_dist import cpu_save_strategy
    from megatron.core import dist_checkpointing

    directory.mkdir(parents=True)
    dist_checkpointing.save(state, str(directory), sharded_strategy=cpu_save_strategy())


def megatron_state(model, iteration: int, **common) -> dict:
    """The state dict Megatron-LM / Bridge save (generate_state_dict): model, optimizer state as ShardedTensors
    mirroring the parameters', and the common part."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model_sd = model.sharded_state_dict()
    optim = {f"exp_avg.{k}": make_sharded_optimizer_tensor(v, torch.full_like(v.data, 7.0), "optimizer.state.exp_avg")
             for k, v in model_sd.items() if k.endswith("weight") and hasattr(v, "global_shape")}
    return {"model": model_sd, "optimizer": optim, "checkpoint_version": 3.0, "iteration": iteration,
            "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": iteration * 8}, **common}


def write_megatron_lm(model, root: Path, iteration: int, planted: Path):
    """Megatron-LM: iter_N/ is the dist checkpoint; common.pt holds `args` (an argparse Namespace, here with a
    payload that runs code if unpickled); tracker latest_checkpointed_iteration.txt."""
    args = argparse.Namespace(num_layers=2, hidden_size=64, payload=Payload(planted))
    megatron_save(megatron_state(model, iteration, args=args), root / f"iter_{iteration:07d}")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def write_bridge(model, root: Path, iteration: int):
    """Megatron Bridge: iter_N/ is the dist checkpoint plus run_config.yaml and train_state.pt; tracker
    latest_train_state.pt (its TrainState, tensors)."""
    d = root / f"iter_{iteration:07d}"
    megatron_save(megatron_state(model, iteration), d)
    train_state = {"step": torch.tensor(iteration, dtype=torch.int32),
                   "consumed_train_samples": torch.tensor(iteration * 8), "do_train": torch.tensor(True)}
    torch.save(train_state, d / "train_state.pt")
    torch.save(train_state, root / "latest_train_state.pt")
    (d / "run_config.yaml").write_text("model:\n  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n"
                                       "  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n"
                                       "  num_query_groups: 2\n")


def kubetron_parts(*overrides: str, model_keys: dict = MODEL):
    """What `kubetron train` builds before it loads: the model, optimizer, scheduler, state, CheckpointManager."""
    from kubetron.checkpoint.manager import CheckpointManager, open_save_store
    from kubetron.training import first_weights
    from kubetron.training.model import build_model
    from kubetron.training.optim import LRScheduler, build_optimizer
    from kubetron.training.state import GlobalState

    ensure_world_of_one()
    cfg = config_for(model_keys, *overrides)
    model = build_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(cfg, model)
    scheduler = LRScheduler(optimizer, cfg)
    state = GlobalState(cfg=cfg)
    ckpt = CheckpointManager(cfg, open_save_store(cfg), model=model, optimizer=optimizer, scheduler=scheduler,
                             train_state=state.train_state, run_id="interop", load_hf=first_weights.load_hf)
    return model, ckpt


def write_snapshot(parent, iteration: int, rank: int = 0, world: int = 2, payload: bytes = b"x" * 1000,
                   run: str = ""):
    """A snapshot of rank `rank` of a gang of `world` in `parent` whose files hold `payload` and a few bytes
    (tests/test_memory_snapshots.py, tests/test_peer_copies.py)."""
    from kubetron.storage import snapshot_files as sf

    def files(w):
        w.write_bytes(f"shards/rank_{rank:05d}.bin", payload)
        w.write_bytes(f"shards/rank_{rank:05d}.json", b'{"pieces": [], "values": {}}')
        w.write_bytes(sf.COMMON_FILE, b"common")
        w.write_bytes(sf.RNG_FILE, b"rng")

    return sf.write_snapshot(parent, lambda written: sf.Manifest(iteration, rank, world, written, run), files,
                             iteration)
