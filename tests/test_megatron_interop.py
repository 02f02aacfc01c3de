"""Interop with megatron-core's own torch_dist checkpoints, both ways, against megatron-core itself (CPU, gloo, 1 rank).

kubetron -> megatron: a checkpoint kubetron's CheckpointManager saves with `ckpt_format: torch_dist` loads
with `dist_checkpointing.load` at its default strictness into megatron's own GPTModel (local layer spec).
megatron -> kubetron: checkpoints written as Megatron-LM and Megatron Bridge write them (megatron's
`dist_checkpointing.save` of `{"model": model.sharded_state_dict(), "optimizer": ..., ...}` into `iter_N/`, with
their trackers and common state) are accepted as `checkpoint.pretrained_checkpoint`. Weights bit-exact both ways.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from tests.hf_utils import config_for
from tests.inprocess import ensure_world_of_one
from tests.multirank.runner import launch

pytest.importorskip("megatron.core")

# a Llama-like model section (RMSNorm, SwiGLU, GQA, untied output, RoPE, no biases)
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
             vocab_size=128, seq_length=32, max_position_embeddings=32, position_embedding_type="rope",
             normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
             share_embeddings_and_output_weights=False, transformer_impl="local")


class _Payload:
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
    args = argparse.Namespace(num_layers=2, hidden_size=64, payload=_Payload(planted))
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
                             train_state=state.train_state, run_id="interop")
    return model, ckpt


def test_megatron_core_loads_kubetron_torch_dist_checkpoint_at_default_strictness(tmp_path):
    """megatron's own load of kubetron's dist/ at its default strictness: every key megatron's GPTModel asks
    for (its `_extra_state` objects included) is there, the weights are bit-exact, and the common part holds
    the iteration and the LR schedule under Megatron-LM's names."""
    from megatron.core import dist_checkpointing

    model, ckpt = kubetron_parts(f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.ckpt_format=torch_dist",
                                 "checkpoint.save_rng=false")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model[0].parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ckpt.train_state.step = 5
    ckpt.save(5)
    dist_dir = tmp_path / "ckpt" / "iter_0000005" / "dist"
    assert (dist_dir / "common.pt").is_file()

    theirs = megatron_gpt(seed=99)
    loaded = dist_checkpointing.load({"model": theirs.sharded_state_dict()}, str(dist_dir))  # default strictness
    theirs.load_state_dict(loaded["model"], strict=True)
    assert_bit_exact(weights(theirs), weights(model[0]))
    assert loaded["iteration"] == 5 and loaded["checkpoint_version"] == 3.0
    assert loaded["opt_param_scheduler"]["num_steps"] == ckpt.scheduler.num_steps
    assert loaded["train_state"]["step"] == 5


@pytest.mark.parametrize("layout", ["megatron-lm", "bridge", "iter-dir"])
def test_finetune_from_megatron_written_checkpoint_is_bit_exact(tmp_path, layout):
    """A torch_dist checkpoint megatron-core wrote (Megatron-LM's layout and tracker, Bridge's, or an iter_ directory
    named directly) is accepted as checkpoint.pretrained_checkpoint: kubetron's model gets megatron's weights
    bit-exact, its optimizer state and common.pt are left alone (the planted pickle never runs)."""
    theirs = megatron_gpt(seed=11)
    planted = tmp_path / "PWNED"
    root = tmp_path / "megatron"
    if layout == "bridge":
        write_bridge(theirs, root, 10)
    else:
        write_megatron_lm(theirs, root, 10, planted)
    if layout != "bridge":  # a second, older checkpoint: the tracker (not the listing) picks iteration 10
        write_bridge(megatron_gpt(seed=12), tmp_path / "older", 4)
        (tmp_path / "older" / "iter_0000004").rename(root / "iter_0000004")
    source = root / "iter_0000010" if layout == "iter-dir" else root
    model, ckpt = kubetron_parts(f"checkpoint.pretrained_checkpoint={source}")
    assert ckpt.load(finetune=True) == 0  # training starts at 0
    assert_bit_exact(weights(model[0]), weights(theirs))
    assert not planted.exists(), "megatron's common.pt was unpickled"
    assert ckpt.train_state.step == 0


def test_megatron_lm_tracker_picks_the_iteration(tmp_path):
    """Megatron-LM's tracker names the checkpoint to take, not the newest directory."""
    root = tmp_path / "megatron"
    write_megatron_lm(megatron_gpt(seed=1), root, 10, tmp_path / "PWNED")
    newer = megatron_gpt(seed=2)
    megatron_save(megatron_state(newer, 20), root / "iter_0000020")
    model, ckpt = kubetron_parts(f"checkpoint.pretrained_checkpoint={root}")
    ckpt.load(finetune=True)
    assert not torch.equal(weights(model[0])["embedding.word_embeddings.weight"],
                           weights(newer)["embedding.word_embeddings.weight"])
    (root / "latest_checkpointed_iteration.txt").write_text("20\n")
    model, ckpt = kubetron_parts(f"checkpoint.pretrained_checkpoint={root}")
    ckpt.load(finetune=True)
    assert_bit_exact(weights(model[0]), weights(newer))


@pytest.mark.parametrize("override, field", [
    ({"num_layers": 3}, "model.num_layers"),
    ({"ffn_hidden_size": 128}, "model.ffn_hidden_size"),
    ({"vocab_size": 256}, "model.vocab_size"),
    ({"num_query_groups": 4}, "model.num_query_groups"),
    ({"share_embeddings_and_output_weights": True}, "model.share_embeddings_and_output_weights"),
    ({"add_bias_linear": True}, "model.add_bias_linear"),
    ({"normalization": "LayerNorm"}, "model.normalization"),
    # the same tensor shapes (hidden 64: 8 heads of 8 with 4 groups = 4 heads of 16 with 2): Bridge's run_config.yaml
    ({"num_attention_heads": 8, "num_query_groups": 4}, "model.num_attention_heads"),
])
def test_architecture_mismatch_names_the_model_key(tmp_path, override, field):
    from kubetron.contract.errors import ConfigError

    root = tmp_path / "megatron"
    write_bridge(megatron_gpt(seed=1), root, 10)
    model, ckpt = kubetron_parts(f"checkpoint.pretrained_checkpoint={root}", model_keys={**MODEL, **override})
    with pytest.raises(ConfigError) as e:
        ckpt.load(finetune=True)
    assert e.value.field == field, str(e.value)
    assert "\n" not in str(e.value)


def test_resuming_a_megatron_checkpoint_points_at_pretrained_checkpoint(tmp_path):
    from kubetron.contract.errors import ConfigError

    root = tmp_path / "megatron"
    write_bridge(megatron_gpt(seed=1), root, 10)
    model, ckpt = kubetron_parts(f"checkpoint.load={root}")
    with pytest.raises(ConfigError) as e:
        ckpt.load()
    assert e.value.field == "checkpoint.load" and "pretrained_checkpoint" in str(e.value)


def test_cli_pp2_finetunes_from_megatron_lm_checkpoint_and_megatron_loads_the_result(tmp_path):
    """End to end under torchrun at PP=2: `kubetron train` fine-tunes from a Megatron-LM checkpoint written at
    PP=1 (each stage reads its own layers), saves torch_dist (each stage writes its own), and megatron-core
    loads that at its default strictness into its own single-stage GPTModel. With lr 0 the step leaves the
    weights alone, so what megatron gets back is bit-exact what it wrote."""
    from megatron.core import dist_checkpointing

    root = tmp_path / "megatron"
    ours = megatron_gpt(seed=5)
    write_megatron_lm(ours, root, 10, tmp_path / "PWNED")
    cfg = {"model": {**MODEL, "pipeline_model_parallel_size": 2},
           "tokenizer": {"tokenizer_type": "null", "vocab_size": 128},
           "train": {"train_iters": 1, "micro_batch_size": 2, "global_batch_size": 4},
           "optimizer": {"lr": 0.0}, "logger": {"log_interval": 1}, "validation": {"eval_interval": None},
           "checkpoint": {"pretrained_checkpoint": str(root), "save": str(tmp_path / "ckpt"),
                          "ckpt_format": "torch_dist", "save_interval": 1}}
    (tmp_path / "run.yaml").write_text(json.dumps(cfg))
    r = launch(["train", "--config", str(tmp_path / "run.yaml")], tmp_path / "ranks")
    assert r.codes == {0: 0, 1: 0}, r.tail()
    assert f"finetuning from weights of {root}/iter_0000010 (iteration 10)" in r.stdout + r.stderr, r.tail()
    assert not (tmp_path / "PWNED").exists()
    theirs = megatron_gpt(seed=6)
    loaded = dist_checkpointing.load({"model": theirs.sharded_state_dict()},
                                     str(tmp_path / "ckpt" / "iter_0000001" / "dist"))
    theirs.load_state_dict(loaded["model"], strict=True)
    assert_bit_exact(weights(theirs), weights(ours))
    assert loaded["iteration"] == 1


def test_unknown_pretrained_checkpoint_version_names_pretrained_checkpoint(tmp_path):
    """A pretrained checkpoint of an unknown kubetron version is refused naming the key the user set."""
    from kubetron.contract.errors import ConfigError

    model, ckpt = kubetron_parts(f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.ckpt_format=kubetron")
    ckpt.save(3)
    common = tmp_path / "ckpt" / "iter_0000003" / "common.pt"
    torch.save({**torch.load(common, weights_only=True), "checkpoint_version": 99}, common)
    model, ckpt = kubetron_parts(f"checkpoint.pretrained_checkpoint={tmp_path / 'ckpt'}")
    with pytest.raises(ConfigError) as e:
        ckpt.load(finetune=True)
    assert e.value.field == "checkpoint.pretrained_checkpoint" and "version 99" in str(e.value)


def test_tensor_check_knows_pipeline_stages():
    """Under PP a stage asks for its own tensors only: what other stages hold is no mismatch, a missing layer is."""
    from kubetron.checkpoint.format_torch_dist import check_tensors
    from kubetron.contract.errors import ConfigError

    saved = {"embedding.word_embeddings.weight": (128, 64), "decoder.layers.mlp.linear_fc2.weight": (2, 64, 96),
             "decoder.final_layernorm.weight": (64,), "output_layer.weight": (128, 64)}
    first = {k: saved[k] for k in ("embedding.word_embeddings.weight", "decoder.layers.mlp.linear_fc2.weight")}
    last = {k: saved[k] for k in ("decoder.layers.mlp.linear_fc2.weight", "decoder.final_layernorm.weight",
                                  "output_layer.weight")}
    check_tensors(first, saved, "ckpt", first=True, last=False)
    check_tensors(last, saved, "ckpt", first=False, last=True)
    with pytest.raises(ConfigError) as e:  # a single stage must hold all of it
        check_tensors(first, saved, "ckpt")
    assert e.value.field == "model.share_embeddings_and_output_weights"  # output_layer.weight names a field
    with pytest.raises(ConfigError) as e:
        check_tensors({**last, "decoder.layers.mlp.linear_fc2.weight": (3, 64, 96)}, saved, "ckpt", first=False)
    assert e.value.field == "model.num_layers"
    with pytest.raises(ConfigError) as e:  # experts only the checkpoint has: an MoE model
        check_tensors(saved, {**saved, "decoder.layers.mlp.experts.weight1": (2, 8, 64)}, "ckpt")
    assert e.value.field == "model.num_moe_experts"
    with pytest.raises(ConfigError) as e:  # a tensor kubetron has no field for: the model section is named
        check_tensors(saved, {**saved, "decoder.layers.self_attention.linear_kv_down_proj.weight": (2, 8, 64)}, "ckpt")
    assert e.value.field == "model"
