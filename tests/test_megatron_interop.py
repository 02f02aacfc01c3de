"""Interop with megatron-core's own torch_dist checkpoints, both ways, against megatron-core itself (CPU, gloo, 1 rank).

kubetron -> megatron: a checkpoint kubetron's CheckpointManager saves with `ckpt_format: torch_dist` loads
with `dist_checkpointing.load` at its default strictness into megatron's own GPTModel (local layer spec).
megatron -> kubetron: checkpoints written as Megatron-LM and Megatron Bridge write them (megatron's
`dist_checkpointing.save` of `{"model": model.sharded_state_dict(), "optimizer": ..., ...}` into `iter_N/`, with
their trackers and common state) are accepted as `checkpoint.pretrained_checkpoint`. Weights bit-exact both ways.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.ckpt_utils import (
    MODEL,
    assert_bit_exact,
    kubetron_parts,
    megatron_gpt,
    megatron_save,
    megatron_state,
    weights,
    write_bridge,
    write_megatron_lm,
)
from tests.multirank.runner import launch

pytestmark = pytest.mark.unit

pytest.importorskip("megatron.core")

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


@pytest.mark.process
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
