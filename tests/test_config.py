"""ConfigContainer: parsing, overrides, derived values, round trip, reporting."""

from __future__ import annotations

import json
import logging

import pytest
import yaml
from kubetron.config import ConfigContainer
from kubetron.contract.config import (
    SECTIONS,
    apply_overrides,
    config_reference_markdown,
    padded_vocab_size,
    parse_data_path,
    parse_split,
)
from kubetron.contract.errors import ConfigError
from kubetron.contract.termination import encode_termination_message
from kubetron.supervisor.termination_log import write_termination_message

pytestmark = pytest.mark.unit

EXAMPLE = "examples/tiny-gpt.yaml"


def make(**sections) -> ConfigContainer:
    data = {"train": {"train_iters": 10}}
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return ConfigContainer.from_dict(data)


def test_defaults_need_only_a_length():
    cfg = make()
    assert cfg.model.num_layers == 2 and cfg.optimizer.lr == 3e-4
    with pytest.raises(ConfigError) as e:
        ConfigContainer.from_dict({})
    assert e.value.field == "train.train_iters"


def test_every_field_has_a_description_and_default():
    for cls in SECTIONS.values():
        assert cls.model_config["extra"] == "forbid"
        assert cls.__doc__
        for name, info in cls.model_fields.items():
            assert info.description, f"{cls.__name__}.{name}"
            assert not info.is_required(), f"{cls.__name__}.{name}"


def test_example_loads_and_finalizes():
    cfg = ConfigContainer.from_yaml(EXAMPLE, ["checkpoint.save=runs/demo"])
    cfg.finalize(world_size=1, environ={})
    assert cfg.train.num_microbatches == 2
    assert cfg.checkpoint.save == "runs/demo"


def test_round_trip_exact(tmp_path):
    cfg = ConfigContainer.from_yaml(EXAMPLE, ["train.iterations_to_skip=[3,4]", "dataset.mock_seed=7"])
    cfg.finalize(world_size=2, environ={"KUBETRON_EXPECTED_ITERATION": "20", "KUBETRON_STATUS_PORT": "8080"})
    text = cfg.to_yaml()
    again = ConfigContainer.from_dict(yaml.safe_load(text))
    assert again == cfg
    assert again.to_yaml() == text
    # finalize is idempotent on a finalized (saved) config
    again.finalize(world_size=2, environ={})
    assert again == cfg
    # and via a file
    path = tmp_path / "run_config.yaml"
    path.write_text(text)
    assert ConfigContainer.from_yaml(str(path)) == cfg
    assert "data_parallel_size: 2" in text


def test_overrides_typed():
    cfg = ConfigContainer.from_yaml(None, [
        "train.train_iters=20", "optimizer.lr=1e-3", "optimizer.min_lr=0.0", "train.iterations_to_skip=[3,4]",
        "checkpoint.save=null", "checkpoint.load=s3://bucket/run", "mixed_precision.bf16=true",
        "dataset.data_path=null", "logger.tensorboard_dir=123", "model.position_embedding_type=learned_absolute",
        "train.exit_duration_in_mins=1.5", "train.manual_gc=false",
    ])
    assert cfg.train.train_iters == 20 and isinstance(cfg.train.train_iters, int)
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.train.iterations_to_skip == [3, 4]
    assert cfg.checkpoint.save is None
    assert cfg.checkpoint.load == "s3://bucket/run"
    assert cfg.mixed_precision.bf16 is True
    assert cfg.logger.tensorboard_dir == "123"
    assert cfg.train.exit_duration_in_mins == 1.5


def test_override_replaces_yaml_value(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  train_iters: 5\n  micro_batch_size: 2\nmodel:\n")
    cfg = ConfigContainer.from_yaml(str(p), ["train.micro_batch_size=4", "model.num_layers=4"])
    assert cfg.train.micro_batch_size == 4 and cfg.model.num_layers == 4 and cfg.train.train_iters == 5


def test_apply_overrides_does_not_mutate_input():
    data = {"train": {"train_iters": 5}}
    apply_overrides(data, ["train.train_iters=6"])
    assert data == {"train": {"train_iters": 5}}


def test_data_parallel_size_and_microbatches():
    cfg = make(train={"micro_batch_size": 2, "global_batch_size": 16}, model={"tensor_model_parallel_size": 2})
    cfg.finalize(world_size=8, environ={})
    assert cfg.data_parallel_size == 4
    assert cfg.train.num_microbatches == 2


def test_global_batch_size_default():
    cfg = make(train={"micro_batch_size": 3})
    cfg.finalize(world_size=4, environ={})
    assert cfg.train.global_batch_size == 12 and cfg.train.num_microbatches == 1


def test_inconsistent_batch_sizes():
    cfg = make(train={"micro_batch_size": 2, "global_batch_size": 10})
    with pytest.raises(ConfigError) as e:
        cfg.finalize(world_size=2, environ={})
    assert e.value.field == "train.global_batch_size"
    assert str(e.value) == ("train.global_batch_size: 10 is not divisible by "
                            "micro_batch_size*data_parallel_size = 4")


def test_world_size_not_divisible_by_model_parallel():
    cfg = make(model={"tensor_model_parallel_size": 2})
    with pytest.raises(ConfigError) as e:
        cfg.finalize(world_size=3, environ={})
    assert e.value.field == "model.tensor_model_parallel_size"


@pytest.mark.parametrize("section, keys, message", [
    ("train", {"train_iters": 10, "micro_batch_size": 2, "global_batch_size": 3},
     "train.global_batch_size: 3 is not divisible by micro_batch_size = 2"),
    ("model", {"num_layers": 3, "pipeline_model_parallel_size": 2},
     "model.num_layers: 3 is not divisible by pipeline_model_parallel_size = 2"),
    ("checkpoint", {"most_recent_k": 0}, "checkpoint.most_recent_k: must be -1 (keep all) or >= 1, got 0"),
    ("peft", {"dim": 8}, "peft.dim: has no effect without peft.scheme: lora"),
])
def test_each_section_checks_its_own_keys_when_built(section, keys, message):
    """A section validates itself (a model validator), whoever builds it: the YAML, an HF import, a test."""
    with pytest.raises(ConfigError) as e:
        SECTIONS[section](**keys)
    assert str(e.value) == message
    with pytest.raises(ConfigError) as e:  # the same words from a whole config
        ConfigContainer.from_dict({"train": {"train_iters": 10}, section: keys})
    assert str(e.value) == message


def test_rules_across_sections_are_the_containers():
    SECTIONS["scheduler"](lr_warmup_init=1.0)  # fine alone: optimizer.lr is another section's
    with pytest.raises(ConfigError, match="scheduler.lr_warmup_init: 1.0 is larger than optimizer.lr = 0.0003"):
        make(scheduler={"lr_warmup_init": 1.0})


def test_derive_is_the_operators_and_resolve_the_trainers():
    """The contract's container derives (pure); reading tokenizer files and the environment is the trainer's."""
    from kubetron.contract import config as schema

    data = {"train": {"train_iters": 10}, "tokenizer": {"tokenizer_type": "HuggingFaceTokenizer",
                                                        "tokenizer_model": "/nowhere/tokenizer.json"}}
    cfg = schema.ConfigContainer.from_dict(data).derive(world_size=2)
    assert cfg.data_parallel_size == 2 and cfg.model.vocab_size is None  # the files are read where they are
    assert not hasattr(cfg, "resolve") and not hasattr(cfg, "finalize") and not hasattr(schema, "load_yaml_file")
    with pytest.raises(ConfigError, match="tokenizer"):
        ConfigContainer.from_dict(data).finalize(world_size=2, environ={}, check_paths=False)


def test_train_iters_from_samples():
    cfg = ConfigContainer.from_dict({"train": {"train_samples": 100, "global_batch_size": 8}})
    cfg.finalize(world_size=1, environ={})
    assert cfg.train.train_iters == 12
    assert cfg.scheduler.lr_decay_steps == 12
    # saved config (both set, consistent) reloads
    assert ConfigContainer.from_dict(cfg.to_dict()) == cfg


def test_train_iters_and_samples_conflict():
    with pytest.raises(ConfigError) as e:
        ConfigContainer.from_dict({"train": {"train_samples": 100, "train_iters": 3}})
    assert e.value.field == "train.train_samples"


def test_train_samples_smaller_than_batch():
    cfg = ConfigContainer.from_dict({"train": {"train_samples": 4, "global_batch_size": 8}})
    with pytest.raises(ConfigError, match="train.train_samples"):
        cfg.finalize(environ={})


@pytest.mark.parametrize("sched, expected", [
    ({}, (0, 100)),
    ({"lr_warmup_iters": 10}, (10, 100)),
    ({"lr_warmup_fraction": 0.1}, (10, 100)),
    ({"lr_decay_iters": 50, "lr_warmup_fraction": 0.2}, (10, 50)),
    ({"lr_decay_style": "constant"}, (0, 100)),
])
def test_scheduler_steps(sched, expected):
    cfg = ConfigContainer.from_dict({"train": {"train_iters": 100}, "scheduler": sched})
    cfg.finalize(environ={})
    assert (cfg.scheduler.lr_warmup_steps, cfg.scheduler.lr_decay_steps) == expected


def test_warmup_longer_than_decay():
    cfg = ConfigContainer.from_dict({"train": {"train_iters": 10}, "scheduler": {"lr_warmup_iters": 10}})
    with pytest.raises(ConfigError, match="scheduler.lr_warmup_iters"):
        cfg.finalize(environ={})


@pytest.mark.parametrize("tok, model, expected", [
    ({}, {}, 384),                                       # 258 -> 384
    ({}, {"make_vocab_size_divisible_by": 1}, 258),
    ({}, {"make_vocab_size_divisible_by": 64, "tensor_model_parallel_size": 2}, 384),
    ({}, {"make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 4}, 512),
    ({"tokenizer_type": "null", "vocab_size": 1000}, {}, 1024),
    ({"tokenizer_type": "null", "vocab_size": 1024}, {}, 1024),
])
def test_padded_vocab(tok, model, expected):
    cfg = ConfigContainer.from_dict({"train": {"train_iters": 1}, "tokenizer": tok, "model": model})
    assert padded_vocab_size(cfg) == expected
    tp = cfg.model.tensor_model_parallel_size
    cfg.finalize(world_size=tp, environ={})
    assert cfg.model.vocab_size == expected


def test_explicit_vocab_kept_and_checked():
    cfg = make(model={"vocab_size": 300})
    cfg.finalize(environ={})
    assert cfg.model.vocab_size == 300
    with pytest.raises(ConfigError, match="model.vocab_size"):
        make(model={"vocab_size": 100})


def test_model_defaults_resolved():
    cfg = make(model={"hidden_size": 32, "seq_length": 128})
    cfg.finalize(environ={})
    m = cfg.model
    assert (m.ffn_hidden_size, m.max_position_embeddings, m.num_query_groups) == (128, 128, 4)


def test_distributed_optimizer_synced():
    cfg = make(optimizer={"use_distributed_optimizer": True})
    cfg.finalize(environ={})
    assert cfg.ddp.use_distributed_optimizer
    cfg = make(ddp={"use_distributed_optimizer": True})
    cfg.finalize(environ={})
    assert cfg.optimizer.use_distributed_optimizer


def test_params_dtype():
    cfg = make(mixed_precision={"bf16": True})
    cfg.finalize(environ={})
    assert cfg.mixed_precision.params_dtype == "bfloat16"
    cfg = make()
    cfg.finalize(environ={})
    assert cfg.mixed_precision.params_dtype == "float32"


def test_environment_defaults(tmp_path):
    log = tmp_path / "term"
    cfg = make()
    cfg.finalize(environ={"KUBETRON_EXPECTED_ITERATION": "30", "KUBETRON_STATUS_PORT": "9000",
                          "KUBETRON_TERMINATION_LOG": str(log)})
    assert cfg.checkpoint.expected_resume_iteration == 30
    assert cfg.train.status_port == 9000
    assert cfg.train.termination_log == str(log)
    # explicit values win over the environment
    cfg = make(train={"status_port": 0}, checkpoint={"expected_resume_iteration": 5})
    cfg.finalize(environ={"KUBETRON_EXPECTED_ITERATION": "30", "KUBETRON_STATUS_PORT": "9000"})
    assert cfg.train.status_port == 0 and cfg.checkpoint.expected_resume_iteration == 5
    with pytest.raises(ConfigError, match="checkpoint.expected_resume_iteration"):
        make().finalize(environ={"KUBETRON_EXPECTED_ITERATION": "x"})


def test_device_resolution():
    cfg = make()
    cfg.finalize(environ={}, cuda_available=False)
    assert cfg.dist.use_gpu is False and cfg.dist.distributed_backend == "gloo"
    cfg = make()
    cfg.finalize(environ={}, cuda_available=True)
    assert cfg.dist.use_gpu is True and cfg.dist.distributed_backend == "nccl"
    with pytest.raises(ConfigError, match="dist.use_gpu"):
        make(dist={"use_gpu": True}).finalize(environ={}, cuda_available=False)


def test_non_persistent_defaults():
    cfg = make(checkpoint={"save": "x", "non_persistent_save_interval": 5})
    cfg.finalize(environ={}, check_paths=False)
    assert cfg.checkpoint.non_persistent_ckpt_type == "global"


def test_profiling_output_dir():
    cfg = make(profiling={"use_pytorch_profiler": True}, checkpoint={"save": "/ckpt"})
    cfg.finalize(environ={})
    assert cfg.profiling.output_dir == "/ckpt/profile"


def test_data_path_checks(tmp_path):
    prefix = tmp_path / "data"
    (tmp_path / "data.bin").write_bytes(b"")
    (tmp_path / "data.idx").write_bytes(b"")
    cfg = make(dataset={"data_path": [str(prefix)]})
    cfg.check_paths()
    assert make(dataset={"data_path": str(prefix)}).dataset.data_path == [str(prefix)]  # one prefix
    with pytest.raises(ConfigError) as e:
        make(dataset={"data_path": [str(tmp_path / "other")]}).check_paths()
    assert e.value.field == "dataset.data_path" and "missing" in e.value.message
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == [(0.7, "a"), (0.3, "b")]
    assert parse_data_path(["a", "b"]) == [(1.0, "a"), (1.0, "b")]
    with pytest.raises(ConfigError):
        parse_data_path(["0.7", "a", "0.3"])


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("99/1") == pytest.approx([0.99, 0.01, 0.0])
    with pytest.raises(ConfigError):
        parse_split("a,b")


def test_checkpoint_paths(tmp_path):
    make(checkpoint={"load": str(tmp_path / "missing")}).check_paths()  # start fresh
    with pytest.raises(ConfigError, match="checkpoint.load"):
        make(checkpoint={"load": str(tmp_path / "missing"), "exit_on_missing_checkpoint": True}).check_paths()
    with pytest.raises(ConfigError, match="checkpoint.pretrained_checkpoint"):
        make(checkpoint={"pretrained_checkpoint": str(tmp_path / "missing")}).check_paths()
    make(checkpoint={"pretrained_checkpoint": "s3://bucket/model"}).check_paths()


def test_non_default_values():
    cfg = ConfigContainer.from_yaml(None, ["train.train_iters=7", "optimizer.lr=0.001", "model.num_layers=4"])
    diffs = cfg.non_default_values()
    assert diffs == {
        "train.train_iters": (None, 7),
        "optimizer.lr": (3e-4, 0.001),
        "model.num_layers": (2, 4),
    }


def test_log_non_default_values(caplog):
    """One line at INFO (a run's start is not a config dump); each value at DEBUG."""
    cfg = make(optimizer={"lr": 0.001})
    log = logging.getLogger("kubetron.test")
    with caplog.at_level(logging.INFO, logger="kubetron.test"):
        cfg.log_non_default_values(log)
    assert len(caplog.records) == 1 and "values differ from the defaults" in caplog.text
    assert "optimizer.lr" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kubetron.test"):
        cfg.log_non_default_values(log)
    assert "optimizer.lr: 0.001 (default 0.0003)" in caplog.text and "train.train_iters" in caplog.text


def test_reference_markdown_lists_every_key():
    md = config_reference_markdown()
    for section, cls in SECTIONS.items():
        assert f"`{section}`" in md
        for name in cls.model_fields:
            assert f"| `{name}` |" in md
    assert "*derived*" in md


def test_termination_message(tmp_path):
    path = tmp_path / "term"
    assert write_termination_message({"exitCode": 2, "reason": "ConfigError", "message": "x"}, str(path))
    assert json.loads(path.read_text()) == {"exitCode": 2, "reason": "ConfigError", "message": "x"}
    big = encode_termination_message({"exitCode": 1, "reason": "TrainerError", "message": "é" * 10000})
    assert len(big) <= 4096 and big.endswith(b"\n")
    assert json.loads(big)["exitCode"] == 1
    assert not write_termination_message({"exitCode": 1}, str(tmp_path / "no" / "such" / "dir"))
