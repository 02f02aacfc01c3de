"""The loop's typed state (StepResult, LossChecks, a GlobalState with declared fields), its timers,
memory metrics, and the experiment trackers (wandb offline, MLflow on a file:// store)."""

from __future__ import annotations

import glob
import json
import struct
import time

import pytest
from kubetron.contract import exitcodes

from tests.inprocess import in_process_config, run_pretrain
from tests.trainer_utils import tb_scalars

pytestmark = pytest.mark.unit

SMALL = ["model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4", "logger.log_interval=2",
         "scheduler.lr_warmup_iters=0"]


def _forward_step():
    from kubetron.training.gpt_step import forward_step

    return forward_step


def test_global_state_has_no_ad_hoc_attributes():
    from kubetron.training.state import GlobalState

    state = GlobalState(cfg=None)
    state.train_state = state.train_state  # declared fields
    with pytest.raises(AttributeError):
        state.loss_window = []  # what the loop used to attach at run time
    with pytest.raises(AttributeError):
        state.ckpt = None  # the run's parts are the composition root's (training.run.Run), not the façade's


@pytest.mark.trainer
def test_a_resume_restores_the_train_state_the_loop_holds_in_place(tmp_path, monkeypatch):
    """The checkpoint manager restores into the parts it was handed: the TrainState the loop (GlobalState)
    held before the load is the one that counts on from the checkpoint's iteration (never a new object)."""
    from kubetron.checkpoint.manager import CheckpointManager
    from kubetron.training.gpt_step import forward_step

    save = f"checkpoint.save={tmp_path}"
    cfg = in_process_config(*SMALL, save, "train.train_iters=2", "checkpoint.save_interval=2")
    assert run_pretrain(cfg, forward_step) == exitcodes.COMPLETED
    held, seen = [], []
    real = CheckpointManager.load

    def load(self, **kw):
        held.append(self.train_state if hasattr(self, "train_state") else self.state.train_state)
        return real(self, **kw)

    def step(state, data_iterator, model):
        seen.append((state.train_state, state.train_state.step))
        return forward_step(state, data_iterator, model)

    monkeypatch.setattr(CheckpointManager, "load", load)
    cfg = in_process_config(*SMALL, save, f"checkpoint.load={tmp_path}", "train.train_iters=4")
    assert run_pretrain(cfg, step) == exitcodes.COMPLETED
    assert min(it for _, it in seen) == 2 and all(ts is held[0] for ts, _ in seen)  # resumed at 2


@pytest.mark.trainer
def test_train_step_returns_a_step_result_and_timers_are_recorded(tmp_path, monkeypatch, capsys):
    """train_step hands back a StepResult; with timing_log_level 2 every loop timer reaches the console
    and TensorBoard (seconds per iteration, Megatron's `<name>-time` names)."""
    from kubetron.training import train as train_mod

    results = []
    real = train_mod.train_step

    def spy(*args):
        results.append(real(*args))
        return results[-1]

    monkeypatch.setattr(train_mod, "train_step", spy)
    cfg = in_process_config(*SMALL, "train.train_iters=4", "logger.timing_log_level=2",
                            "logger.log_timers_to_tensorboard=true", f"logger.tensorboard_dir={tmp_path}/tb")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    assert [type(r).__name__ for r in results] == ["StepResult"] * 4
    assert all(not r.skipped and r.loss_scale == 1.0 and set(r.loss_dict) == {"lm loss"} for r in results)
    names = ["iteration", "forward-backward", "grads", "optimizer", "save-checkpoint", "forward-compute",
             "backward-compute"]
    for name in names:
        series = tb_scalars(tmp_path / "tb", f"{name}-time")
        assert sorted(series) == [2, 4] and all(v > 0 for v in series.values()), name
    it, fb = tb_scalars(tmp_path / "tb", "iteration-time"), tb_scalars(tmp_path / "tb", "forward-backward-time")
    assert all(fb[i] < it[i] for i in (2, 4))  # nested in the iteration
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith(" time (ms, per iteration) |")]
    # the whole iteration is the console line's "elapsed time per iteration": not repeated in the timers line
    assert len(lines) == 2 and all("interval-time" not in ln and "backward-compute:" in ln for ln in lines)

    cfg = in_process_config(*SMALL, "train.train_iters=2", "logger.timing_log_level=0")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    out = capsys.readouterr().out
    assert "time (ms, per iteration)" not in out and "elapsed time per iteration (ms)" in out


def test_memory_metrics_use_the_reference_names_in_gigabytes():
    from kubetron.training.utils import report_memory

    stats = {"allocated_bytes.all.current": 1_234_567_890, "allocated_bytes.all.peak": 2.5e9,
             "reserved_bytes.all.peak": 0, "num_alloc_retries": 3}
    assert report_memory(stats=stats) == {"mem-allocated-gigabytes": 1.2346, "mem-max-allocated-gigabytes": 2.5,
                                          "mem-max-reserved-gigabytes": 0.0, "mem-alloc-retires": 3.0}


def wandb_history(path: str) -> dict[str, dict[int, float]]:
    """{key: {step: value}} from an offline run's .wandb file (a LevelDB-style log of Record protos:
    32 KiB blocks of pieces with a 7-byte header crc32/length/type; 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, piece, out = 7, 32768, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero fill (a flush ended the block early): the next block goes on
            pos += block - pos % block
            continue
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(piece)
            piece = b""
            if rec.WhichOneof("record_type") == "history":
                for item in rec.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        out.setdefault(key, {})[rec.history.step.num] = json.loads(item.value_json)
    return out


@pytest.mark.trainer
def test_wandb_and_mlflow_runs_hold_the_tensorboard_series(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file:// stores behind this switch
    uri = f"file://{tmp_path}/mlruns"
    cfg = in_process_config(*SMALL, "train.train_iters=6", f"logger.tensorboard_dir={tmp_path}/tb",
                            "logger.wandb_project=kubetron-test", "logger.wandb_exp_name=tiny",
                            f"logger.wandb_save_dir={tmp_path}", "logger.mlflow_experiment=kubetron-test",
                            "logger.mlflow_run_name=tiny", f"logger.mlflow_tracking_uri={uri}",
                            "logger.mlflow_tags={team: ml}")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    tb = tb_scalars(tmp_path / "tb")
    assert sorted(tb) == list(range(1, 7))

    (wandb_file,) = glob.glob(f"{tmp_path}/wandb/offline-run-*/run-*.wandb")
    # wandb's own service process writes the file: under load its last records may land just after finish().
    deadline = time.monotonic() + 30
    while set((wb := wandb_history(wandb_file)).get("lm loss") or ()) != set(tb) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert wb["lm loss"] == pytest.approx(tb, rel=1e-6)  # TensorBoard stores float32
    assert set(wb["learning-rate"]) == set(tb)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("kubetron-test").experiment_id])
    assert run.info.run_name == "tiny" and run.data.tags["team"] == "ml"
    ml = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "lm loss")}
    assert ml == pytest.approx(tb, rel=1e-6)


def test_tracker_without_its_package_is_a_config_error(monkeypatch):
    import importlib.util

    from kubetron.contract.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logger.wandb_project: needs the wandb package"):
        in_process_config("logger.wandb_project=x").finalize()
