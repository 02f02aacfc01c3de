"""Config keys that were accepted and then did nothing (or crashed a resume): each now acts or is refused.

The checks run `pretrain()` in this process on one small saved run (module fixture); the exit code and the one
line of a spec error are checked once through `kubetron train`'s own path (tests/inprocess.command).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from kubetron.contract import exitcodes
from kubetron.contract.errors import ConfigError

from tests.inprocess import command, in_process_config, run_pretrain
from tests.trainer_utils import TINY, tb_scalars

pytestmark = pytest.mark.trainer

SMALL = ["model.seq_length=32", "scheduler.lr_warmup_iters=0", "train.micro_batch_size=2", "train.global_batch_size=4",
         "logger.log_interval=1"]


def _forward_step():
    from kubetron.training.gpt_step import forward_step

    return forward_step


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """3 iterations saved at 2 and 3, with checkpoint.save_rng false; the loss trace from TensorBoard."""
    d = tmp_path_factory.mktemp("traps")
    cfg = in_process_config(*SMALL, "train.train_iters=3", f"checkpoint.save={d}/ckpt", "checkpoint.save_interval=2",
                            "checkpoint.save_rng=false", f"logger.tensorboard_dir={d}/tb")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    return SimpleNamespace(ckpt=d / "ckpt", loss=tb_scalars(d / "tb"))


def test_resume_of_a_checkpoint_saved_without_rng(saved, tmp_path):
    """checkpoint.save_rng false used to make every resume crash (KeyError: 'random')."""
    assert not (saved.ckpt / "iter_0000002" / "rng").exists()
    cfg = in_process_config(*SMALL, f"checkpoint.load={saved.ckpt}", "checkpoint.ckpt_step=2", "train.train_iters=3",
                            f"logger.tensorboard_dir={tmp_path}/tb")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    assert tb_scalars(tmp_path / "tb")[3] == pytest.approx(saved.loss[3], rel=1e-6)


def test_exit_signal_is_honoured_by_pretrain(tmp_path):
    """train.exit_signal=SIGUSR1 through the Python API: the run saves and exits 75 on SIGUSR1."""
    fwd = _forward_step()

    def forward_step(state, data_iterator, model):
        if state.train_state.step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # delivered before the step ends
        return fwd(state, data_iterator, model)

    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # without the fix: ignored, the run completes
    try:
        cfg = in_process_config(*SMALL, "train.train_iters=5", "train.exit_signal_handler=true",
                                "train.exit_signal=SIGUSR1", f"checkpoint.save={tmp_path}/ckpt")
        assert run_pretrain(cfg, forward_step) == exitcodes.SAVED_ON_SIGNAL
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000002"]


def test_logging_level_is_applied(caplog):
    caplog.set_level(logging.DEBUG, logger="kubetron")
    cfg = in_process_config(*SMALL, "train.train_iters=1", "logger.logging_level=WARNING")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    assert [r.getMessage() for r in caplog.records if r.name == "kubetron" and r.levelno < logging.WARNING] == []
    cfg = in_process_config(*SMALL, "train.train_iters=1", "logger.logging_level=INFO")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    assert any("parameters" in r.getMessage() for r in caplog.records)


def test_train_starts_from_pretrained_checkpoint(saved, tmp_path, caplog):
    """`train` with checkpoint.pretrained_checkpoint (and nothing to resume): weights from it, iteration 0."""
    caplog.set_level(logging.INFO, logger="kubetron")
    cfg = in_process_config(*SMALL, "train.train_iters=1", f"checkpoint.pretrained_checkpoint={saved.ckpt}",
                            f"logger.tensorboard_dir={tmp_path}/tb")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    assert "finetuning from weights of" in caplog.text and "iter_0000003" in caplog.text
    assert tb_scalars(tmp_path / "tb")[1] < saved.loss[1] - 0.05  # trained weights, not a fresh init


def test_spec_errors_on_resume_are_config_errors(saved, tmp_path):
    """ckpt_step not in the store, another architecture, a newer checkpoint version: one-line errors (exit 2)."""
    with pytest.raises(ConfigError, match=r"checkpoint.ckpt_step: 7: .* no complete iter_0000007"):
        run_pretrain(in_process_config(*SMALL, f"checkpoint.load={saved.ckpt}", "checkpoint.ckpt_step=7",
                                       "train.train_iters=9"), _forward_step())
    with pytest.raises(ConfigError, match=r"^model.hidden_size: .*checkpoint 64, this run 32"):
        run_pretrain(in_process_config(*SMALL, f"checkpoint.load={saved.ckpt}", "model.hidden_size=32",
                                       "train.train_iters=9"), _forward_step())
    newer = tmp_path / "newer"
    shutil.copytree(saved.ckpt, newer)
    common = torch.load(newer / "iter_0000003" / "common.pt", weights_only=True)
    common["checkpoint_version"] = 99
    torch.save(common, newer / "iter_0000003" / "common.pt")
    with pytest.raises(ConfigError, match=r"^checkpoint.load: .*iter_0000003 has checkpoint version 99"):
        run_pretrain(in_process_config(*SMALL, f"checkpoint.load={newer}", "train.train_iters=9"), _forward_step())


def test_missing_ckpt_step_exits_2_with_one_line(saved, capsys):
    code, _, err = command(capsys, "train", "--config", TINY, *SMALL, f"checkpoint.load={saved.ckpt}",
                           "checkpoint.ckpt_step=7", "checkpoint.save=null", "train.train_iters=9")
    assert code == 2, err
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        f"kubetron: error: checkpoint.ckpt_step: 7: {saved.ckpt} has no complete iter_0000007 (complete: [2, 3])"]


def test_resume_names_settings_changed_since_the_checkpoint(saved, caplog):
    """run_config.yaml is read back: a resume logs what this run changes."""
    caplog.set_level(logging.INFO, logger="kubetron")
    cfg = in_process_config(*SMALL, f"checkpoint.load={saved.ckpt}", "train.train_iters=3", "optimizer.lr=0.002")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    assert "settings changed since iter_0000003: optimizer.lr: 0.001 -> 0.002" in caplog.text


def test_cumulative_throughput_counts_only_flops_since_the_gpu_count_changed(tmp_path):
    """A job at 2 GPUs did 1e15 FLOPs; this job (1 GPU) adds 3e12 in ~1 s: ~3 TFLOP/s, not ~1000."""
    from kubetron.checkpoint.progress_log import PodFacts, ProgressLog
    from kubetron.contract import progress
    from kubetron.events import Checkpoint, CheckpointDurable, Started
    from kubetron.storage import open_store

    store = open_store(str(tmp_path))
    store.append_line("progress.txt", progress.starting_job_line(iteration=0, train_iters=10, num_gpus=2, job_id=""))
    store.append_line("progress.txt", progress.saved_checkpoint_line(
        iteration=5, job_throughput_tflops=1.0, cumulative_throughput_tflops=1.0, flops_so_far=1e15,
        tokens_so_far=100, train_iters=10, num_gpus=2, async_save=False, job_id=""))
    cfg = in_process_config()
    log = ProgressLog(cfg, store, 1, PodFacts(job_id=""))
    log(Started(5, 10, 40, 1e15, None))
    start, _ = progress.get_start_time_from_progress_log(store.read_bytes("progress.txt").decode(), 1)
    taken = time.time()
    durable = CheckpointDurable(Checkpoint(6, None), taken, {"floating_point_operations_so_far": 1e15 + 3e12,
                                                              "consumed_train_samples": 48}, 1.0, 1.0, False)
    tflops = log.fields(durable)["cumulative_throughput_tflops"]
    assert tflops == pytest.approx(3.0 / (taken - start.timestamp()))
