"""Trainer features a user notices: finetune, preprocess + real text, iterations_to_skip, NaN/Inf
stops, exit conditions, checkpoint retention/selection/safety, TensorBoard keys and log lines.

Everything runs in this process (tests/inprocess.py): `kubetron train|finetune|preprocess`'s own path
(`drive`, `command`) where the command's exit code, console, termination message or progress log is the point,
`pretrain()` where the run's numbers are.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kubetron.contract import exitcodes
from kubetron.training.state import GlobalState, TrainState

from tests.inprocess import Driver, command, console, drive, in_process_config, run_pretrain
from tests.trainer_utils import TINY, tb_scalars

pytestmark = pytest.mark.trainer

PRE_ITERS = 40


def iter_dirs(d: Path) -> list[str]:
    return sorted(p.name for p in Path(d).iterdir() if p.is_dir() and p.name.startswith("iter_"))


def tracker_iteration(d: Path) -> int:
    return int(torch.load(Path(d) / "latest_train_state.pt", weights_only=True)["iteration"])


def tb_tags(logdir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for f in Path(logdir).rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags().get("scalars", []))
    return tags


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A 40-iteration pretraining run (checkpoints every 10, most_recent_k=2, TensorBoard)."""
    d = tmp_path_factory.mktemp("pretrained")
    ckpt = d / "ckpt"
    with console() as out:
        run = drive(d, f"train.train_iters={PRE_ITERS}", f"checkpoint.save={ckpt}", "checkpoint.save_interval=10",
                    "checkpoint.most_recent_k=2", "logger.log_interval=1", f"logger.tensorboard_dir={d}/tb",
                    "logger.log_l2_norm_grad_to_tensorboard=true", "validation.eval_interval=null")
    assert run.code == 0
    return SimpleNamespace(dir=d, ckpt=ckpt, stdout=out.getvalue(), loss=tb_scalars(d / "tb"),
                           lr=tb_scalars(d / "tb", "learning-rate"))


# --------------------------------------------------------------------------------------------------
# Logging: console line, TensorBoard keys, non-default values
# --------------------------------------------------------------------------------------------------


def test_console_line_tensorboard_keys_and_non_default_values(pretrained):
    tags = tb_tags(pretrained.dir / "tb")
    for key in ("lm loss", "learning-rate", "grad-norm", "throughput/tokens_per_sec",
                "throughput/device/tokens_per_sec", "time/remaining_estimate", "time/tokens",
                "l2_norm/grad/global"):
        assert key in tags, f"TensorBoard lacks {key!r}: {sorted(tags)}"
    assert sorted(pretrained.loss) == list(range(1, PRE_ITERS + 1))

    lines = [ln for ln in pretrained.stdout.splitlines() if re.search(r"iteration\s+\d+/\s*\d+ \|", ln)]
    assert len(lines) == PRE_ITERS  # log_interval=1
    last = lines[-1]
    for field in (rf"iteration\s+{PRE_ITERS}/\s+{PRE_ITERS}", r"consumed samples:\s+320",
                  r"elapsed time per iteration \(ms\): [\d.]+", r"learning rate: [\d.E+-]+",
                  r"global batch size:\s+8", r"lm loss: [\d.E+-]+", r"loss scale: 1\.0", r"grad norm: [\d.]+",
                  r"number of skipped iterations:\s+0", r"number of nan iterations:\s+0",
                  r"throughput per GPU \(TFLOP/s/GPU\): [\d.]+"):
        assert re.search(field, last), f"console line lacks {field!r}: {last}"

    out = pretrained.stdout  # the values that differ from the defaults: one line at INFO, listed at DEBUG
    assert len(re.findall(r"Configuration: \d+ values differ from the defaults", out)) == 1
    assert f"train.train_iters: {PRE_ITERS} (default null)" not in out


# --------------------------------------------------------------------------------------------------
# Checkpoints: retention, selection, safety
# --------------------------------------------------------------------------------------------------


def test_most_recent_k_keeps_the_newest_k(pretrained):
    assert iter_dirs(pretrained.ckpt) == ["iter_0000030", "iter_0000040"]
    assert tracker_iteration(pretrained.ckpt) == 40
    progress = (pretrained.ckpt / "progress.txt").read_text()
    assert [int(x) for x in re.findall(r"Saved checkpoint\tIteration: (\d+)", progress)] == [10, 20, 30, 40]


def test_retention_never_deletes_the_newest_complete_checkpoint(tmp_path):
    """An incomplete newer directory (no commit marker) does not count: the newest complete stays."""
    from kubetron.checkpoint.layout import MARKER
    from kubetron.checkpoint.manager import CheckpointManager
    from kubetron.config import ConfigContainer
    from kubetron.storage import open_store

    store = tmp_path / "store"
    for it in (10, 20, 30, 40):
        d = store / f"iter_{it:07d}"
        d.mkdir(parents=True)
        (d / "model.pt").write_bytes(b"x")
        if it != 40:  # iteration 40: a save that never committed
            (d / MARKER).write_text(json.dumps({"iteration": it}))
    cfg = ConfigContainer.from_yaml(TINY, [f"checkpoint.save={store}", "checkpoint.most_recent_k=1"])
    mgr = CheckpointManager(cfg, open_store(store), model=None, optimizer=None, scheduler=None,
                            train_state=TrainState(), run_id="test")
    mgr._apply_retention()
    assert iter_dirs(store) == ["iter_0000030", "iter_0000040"]

    cfg.checkpoint.most_recent_k = 2
    (store / "iter_0000040" / MARKER).write_text(json.dumps({"iteration": 40}))
    mgr._apply_retention()
    assert iter_dirs(store) == ["iter_0000030", "iter_0000040"]


class _Recorder:
    """Wraps the default GPT forward step; records (iteration, first global sample index)."""

    def __init__(self, nan_at: int | None = None):
        self.seen: list[tuple[int, int]] = []
        self.state: GlobalState | None = None
        self.nan_at = nan_at

    def __call__(self, state: GlobalState, data_iterator, model):
        from kubetron.training.gpt_step import forward_step

        self.state = state
        iteration = state.train_state.step + 1
        self.seen.append((iteration, data_iterator.sample_indices()[0]))
        output, loss_func = forward_step(state, data_iterator, model)
        if iteration != self.nan_at:
            return output, loss_func

        def nan_loss(out):
            loss, n, report = loss_func(out)
            return loss * float("nan"), n, {k: v * float("nan") for k, v in report.items()}

        return output, nan_loss


def test_ckpt_step_and_iter_dir_load(pretrained, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kubetron")
    rec = _Recorder()
    # the pretrained run's config (same schedule), stopped after 2 more iterations by exit_interval
    cfg = in_process_config(f"checkpoint.load={pretrained.ckpt}", "checkpoint.ckpt_step=30",
                            f"train.train_iters={PRE_ITERS}", "train.exit_interval=32", "logger.log_interval=1",
                            f"logger.tensorboard_dir={tmp_path}/tb30")
    assert run_pretrain(cfg, rec) == exitcodes.EXIT_CONDITION
    assert re.search(r"resumed from \S+/iter_0000030 at iteration 30", caplog.text)
    assert rec.seen[0] == (31, 30 * 8)  # the model, counters and data position of iteration 30
    loss = tb_scalars(tmp_path / "tb30")
    assert sorted(loss) == [31, 32]
    assert loss[31] == pretrained.loss[31] and loss[32] == pretrained.loss[32]  # bit-exact continuation

    caplog.clear()
    rec = _Recorder()
    cfg = in_process_config(f"checkpoint.load={pretrained.ckpt}/iter_0000030", "train.train_iters=31")
    assert run_pretrain(cfg, rec) == exitcodes.COMPLETED
    assert re.search(r"resumed from \S+ckpt/iter_0000030 at iteration 30", caplog.text)
    assert rec.seen[0] == (31, 240)

    # without ckpt_step: the tracker's (newest) checkpoint
    caplog.clear()
    cfg = in_process_config(f"checkpoint.load={pretrained.ckpt}", "train.train_iters=41")
    rec = _Recorder()
    assert run_pretrain(cfg, rec) == exitcodes.COMPLETED
    assert rec.seen[0][0] == 41 and "iter_0000040 at iteration 40" in caplog.text


def test_ckpt_step_that_does_not_exist_is_refused(pretrained):
    from kubetron.contract.errors import ConfigError

    cfg = in_process_config(f"checkpoint.load={pretrained.ckpt}", "checkpoint.ckpt_step=10", "train.train_iters=41")
    with pytest.raises(ConfigError, match=r"ckpt_step: 10.*no complete iter_0000010"):
        run_pretrain(cfg, _Recorder())


def test_architecture_mismatch_names_the_field(pretrained):
    from kubetron.contract.errors import ConfigError

    cfg = in_process_config(f"checkpoint.load={pretrained.ckpt}", "train.train_iters=50", "model.hidden_size=128")
    with pytest.raises(ConfigError) as e:  # a spec error: exit 2
        run_pretrain(cfg, _Recorder())
    msg = str(e.value)
    assert "model.hidden_size: checkpoint 64, this run 128" in msg
    assert "iter_0000040" in msg


class Payload:
    """Unpickling this calls open(path, 'w'): code execution from a checkpoint file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_planted_pickle_is_refused_and_never_runs(pretrained, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(pretrained.ckpt, store)
    marker = tmp_path / "PWNED"
    torch.save({"iteration": Payload(marker)}, store / "iter_0000040" / "common.pt")

    # the payload is live: plain unpickling (what an unsafe load does) runs it
    pickle.loads(pickle.dumps({"x": Payload(tmp_path / "probe-ran")}))
    assert (tmp_path / "probe-ran").exists()

    capsys.readouterr()
    out = drive(tmp_path, f"checkpoint.load={store}", "checkpoint.save=null", "train.train_iters=50")
    err = capsys.readouterr().err
    assert out.code == exitcodes.ERROR
    assert not marker.exists(), "the pickle payload ran"
    assert "Traceback" not in err
    assert re.search(r"checkpoint error: refusing to load iter_0000040/common\.pt", err), err[-2000:]
    assert out.termination["exitCode"] == exitcodes.ERROR
    assert "refusing to load iter_0000040/common.pt" in out.termination["message"]


# --------------------------------------------------------------------------------------------------
# finetune
# --------------------------------------------------------------------------------------------------


def _adam_step(ckpt: Path) -> int:
    from kubetron.checkpoint.format_sharded import read_canonical
    from kubetron.storage import open_store

    _, optim = read_canonical(open_store(ckpt.parent), ckpt.name)
    steps = {int(s["step"]) for s in optim.values()}
    assert len(steps) == 1
    return steps.pop()


def test_finetune_from_parent_dir_then_resume_from_its_own_checkpoint(pretrained, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kubetron")
    ft = tmp_path / "ft"
    args = [f"checkpoint.pretrained_checkpoint={pretrained.ckpt}", f"checkpoint.save={ft}", f"checkpoint.load={ft}",
            "checkpoint.save_interval=100", "train.train_iters=24", "scheduler.lr_warmup_iters=2",
            "logger.log_interval=1", f"logger.tensorboard_dir={ft}/tb", "validation.eval_interval=null"]
    out = drive(tmp_path, *args, mode="finetune", driver=Driver().signal_at(3))
    assert out.code == exitcodes.SAVED_ON_SIGNAL
    assert re.search(r"finetuning from weights of \S+ckpt/iter_0000040 \(iteration 40\); training starts at 0",
                     caplog.text)
    loss, lr = tb_scalars(ft / "tb"), tb_scalars(ft / "tb", "learning-rate")
    assert sorted(loss) == [1, 2, 3], "finetuning starts at iteration 0"
    fresh = pretrained.loss[1]  # a freshly initialised model on the same first batch
    assert loss[1] < fresh - 0.5, f"weights not loaded: first loss {loss[1]} vs fresh {fresh}"
    assert lr[1] == pytest.approx(0.5e-3)  # fresh schedule: warmup 1/2 of lr=1e-3 (pretrained ended at min_lr)
    assert out.termination["lastCheckpoint"] == 3
    assert _adam_step(ft / "iter_0000003") == 3  # fresh optimizer, not 40 + 3

    caplog.clear()
    assert drive(tmp_path, *args, mode="finetune").code == 0
    assert re.search(r"resumed from \S+ft/iter_0000003 at iteration 3", caplog.text)
    assert "finetuning from weights" not in caplog.text
    assert _adam_step(ft / "iter_0000024") == 24


def test_finetune_from_an_iter_dir(pretrained, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kubetron")
    ft = tmp_path / "ft"
    out = drive(tmp_path, f"checkpoint.pretrained_checkpoint={pretrained.ckpt}/iter_0000030", "checkpoint.save=null",
                "train.train_iters=2", "scheduler.lr_warmup_iters=1", "logger.log_interval=1",
                f"logger.tensorboard_dir={ft}/tb", "validation.eval_interval=null", mode="finetune")
    assert out.code == 0
    assert re.search(r"finetuning from weights of \S+ckpt/iter_0000030 \(iteration 30\)", caplog.text)
    loss = tb_scalars(ft / "tb")
    assert sorted(loss) == [1, 2]
    assert loss[1] < pretrained.loss[1] - 0.5


def test_finetune_missing_pretrained_checkpoint_is_a_config_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KUBETRON_TERMINATION_LOG", str(tmp_path / "termination"))
    code, _, err = command(capsys, "finetune", "--config", TINY, f"checkpoint.pretrained_checkpoint={tmp_path}/nope",
                           "checkpoint.save=null")
    assert code == exitcodes.CONFIG_ERROR
    line = one_error_line(err)
    assert line.startswith("kubetron: error: checkpoint.pretrained_checkpoint: ") and "nope" in line
    assert json.loads((tmp_path / "termination").read_text())["exitCode"] == exitcodes.CONFIG_ERROR


# --------------------------------------------------------------------------------------------------
# preprocess + training on real text
# --------------------------------------------------------------------------------------------------

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A checkpoint is written every ten iterations and resumed exactly.",
    "Kubernetes restarts the pod and the trainer continues where it stopped.",
    "The loss falls as the model learns which byte follows which.",
]


def test_preprocess_then_train_on_it(tmp_path, capsys, caplog):
    corpus = tmp_path / "corpus.jsonl"
    with corpus.open("w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"{i}: " + " ".join(SENTENCES[(i + j) % 4] for j in range(3))}) + "\n")
    text = tmp_path / "notes.txt"  # plain text: documents separated by blank lines
    text.write_text("\n\n".join(" ".join(SENTENCES[i:] + SENTENCES[:i]) for i in range(4)) + "\n")
    prefix = tmp_path / "data" / "corpus"
    code, out, err = command(capsys, "preprocess", "--input", str(corpus), str(text), "--output-prefix", str(prefix))
    assert code == 0, err[-3000:]
    assert json.loads(out)["documents"] == 300 + 4
    assert prefix.with_suffix(".bin").is_file() and prefix.with_suffix(".idx").is_file()

    d = tmp_path / "run"
    caplog.set_level(logging.DEBUG, logger="kubetron")
    assert drive(tmp_path, f"dataset.data_path={prefix}", "train.train_iters=30", "checkpoint.save=null",
                 "logger.log_interval=5", f"logger.tensorboard_dir={d}/tb", "validation.eval_interval=null",
                 "logger.logging_level=DEBUG").code == 0
    assert "dataset.data_path: " in caplog.text  # a non-default value, listed at DEBUG
    loss = tb_scalars(d / "tb")
    assert sorted(loss) == list(range(1, 31))
    assert loss[30] < loss[1] - 1.0, f"loss did not fall on the text: {loss[1]} -> {loss[30]}"

    # missing .bin / .idx: one line naming dataset.data_path, exit 2
    code, _, err = command(capsys, "train", "--config", TINY, f"dataset.data_path={tmp_path}/absent")
    assert code == exitcodes.CONFIG_ERROR
    line = one_error_line(err)
    assert "dataset.data_path" in line and "absent.bin" in line and "absent.idx" in line
    prefix.with_suffix(".idx").unlink()
    code, _, err = command(capsys, "train", "--config", TINY, f"dataset.data_path={prefix}")
    assert code == exitcodes.CONFIG_ERROR
    line = one_error_line(err)
    assert "dataset.data_path" in line and "corpus.idx" in line and "corpus.bin" not in line


# --------------------------------------------------------------------------------------------------
# iterations_to_skip
# --------------------------------------------------------------------------------------------------


def test_iterations_to_skip_consumes_the_data(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="kubetron")
    base = ["train.train_iters=5", "scheduler.lr_warmup_iters=1", "logger.log_interval=1"]
    plain = _Recorder()
    assert run_pretrain(in_process_config(*base), plain) == exitcodes.COMPLETED
    capsys.readouterr()
    caplog.clear()
    skip = _Recorder()
    assert run_pretrain(in_process_config(*base, "train.iterations_to_skip=[3]"), skip) == exitcodes.COMPLETED
    out = capsys.readouterr().out

    # 2 micro-batches of 4 per iteration; first global sample index each micro-batch reads (the training
    # reads: the evaluations after training follow, at "iteration" 6)
    assert [s for s in plain.seen if s[0] <= 5] == [(1, 0), (1, 4), (2, 8), (2, 12), (3, 16), (3, 20), (4, 24),
                                                    (4, 28), (5, 32), (5, 36)]
    assert [s for s in skip.seen if s[0] <= 5] == [(1, 0), (1, 4), (2, 8), (2, 12), (4, 24), (4, 28), (5, 32),
                                                   (5, 36)]
    assert "iteration 3 skipped (iterations_to_skip)" in caplog.text
    assert re.search(r"iteration\s+4/\s+5 \| consumed samples:\s+32 \|", out)
    assert not re.search(r"iteration\s+3/", out)  # nothing computed, nothing logged for it
    ts = skip.state.train_state
    assert (ts.step, ts.consumed_train_samples, ts.skipped_train_samples) == (5, 40, 8)
    assert plain.state.train_state.skipped_train_samples == 0


# --------------------------------------------------------------------------------------------------
# NaN / Inf
# --------------------------------------------------------------------------------------------------


def test_nan_loss_stops_with_exit_code_3(tmp_path, capsys):
    """lr=1e6 without clipping diverges: exit 3, a clear message naming the iteration, termination log."""
    capsys.readouterr()
    out = drive(tmp_path, "optimizer.lr=1e6", "optimizer.clip_grad=0", "scheduler.lr_warmup_iters=0",
                "scheduler.lr_decay_style=constant", "train.train_iters=20", "logger.log_interval=1",
                f"checkpoint.save={tmp_path}/ckpt")
    err = capsys.readouterr().err
    assert out.code == exitcodes.DIVERGED
    m = re.search(r"kubetron: Diverged: loss is NaN/Inf at iteration (\d+)", err)
    assert m, err[-2000:]
    assert "Traceback" not in err
    assert out.termination["exitCode"] == exitcodes.DIVERGED and out.termination["reason"] == "Diverged"
    assert f"at iteration {m.group(1)}" in out.termination["message"]


def test_nan_from_a_forward_step_names_the_iteration():
    from kubetron.training.train import DivergedError

    rec = _Recorder(nan_at=4)
    with pytest.raises(DivergedError, match=r"loss is NaN/Inf at iteration 4\b"):
        run_pretrain(in_process_config("train.train_iters=20"), rec)
    assert rec.state.train_state.step == 3  # iteration 4 never applied its update


def test_nan_loss_with_the_loss_check_off_stops_at_the_gradient_check():
    """As Megatron: the NaN loss gives NaN gradients, which ddp.check_for_nan_in_grad stops on (exit 3)."""
    from kubetron.training.train import DivergedError

    cfg = in_process_config("train.train_iters=6", "scheduler.lr_warmup_iters=1", "train.check_for_nan_in_loss=false")
    with pytest.raises(DivergedError, match=r"gradient norm is nan at iteration 4 \(ddp.check_for_nan_in_grad\)"):
        run_pretrain(cfg, _Recorder(nan_at=4))


def test_nan_with_the_check_off_in_fp16_skips_the_update_and_counts_it(capsys):
    """fp16: the NaN loss's gradients are a loss-scale overflow, so the update is skipped and counted."""
    rec = _Recorder(nan_at=4)
    cfg = in_process_config("train.train_iters=6", "scheduler.lr_warmup_iters=1", "logger.log_interval=1",
                            "train.check_for_nan_in_loss=false", "mixed_precision.fp16=true",
                            "mixed_precision.initial_loss_scale=1024")
    assert run_pretrain(cfg, rec) == exitcodes.COMPLETED
    lines = {int(m.group(1)): ln for ln in capsys.readouterr().out.splitlines()
             if (m := re.search(r"iteration\s+(\d+)/", ln))}
    assert re.search(r"number of skipped iterations:\s+1 \| number of nan iterations:\s+1 \|", lines[4]), lines[4]
    assert re.search(r"number of skipped iterations:\s+0 \| number of nan iterations:\s+0 \|", lines[5])
    assert re.search(r"lm loss: \d", lines[5])  # training goes on with finite losses


# --------------------------------------------------------------------------------------------------
# exit_interval / exit_duration_in_mins
# --------------------------------------------------------------------------------------------------


def _check_exit_condition(out, ckpt: Path, iteration: int):
    assert out.code == exitcodes.EXIT_CONDITION
    assert (ckpt / f"iter_{iteration:07d}" / "metadata.json").is_file()
    assert tracker_iteration(ckpt) == iteration
    progress = (ckpt / "progress.txt").read_text().splitlines()
    assert re.search(rf"\tExiting job\tIteration: {iteration}\tReason: ExitCondition\b", progress[-1]), progress[-1]
    assert out.termination["reason"] == "ExitCondition" and out.termination["lastCheckpoint"] == iteration


def test_exit_interval(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kubetron")
    ckpt = tmp_path / "ckpt"
    out = drive(tmp_path, "train.train_iters=12", "train.exit_interval=4", f"checkpoint.save={ckpt}",
                "checkpoint.save_interval=100", "logger.log_interval=1", "validation.eval_interval=null")
    _check_exit_condition(out, ckpt, 4)
    assert iter_dirs(ckpt) == ["iter_0000004"]
    assert "exit_interval (4) reached at iteration 4" in caplog.text


def test_exit_duration_in_mins(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kubetron")
    ckpt = tmp_path / "ckpt"
    out = drive(tmp_path, "train.train_iters=1000", "train.exit_duration_in_mins=0.0005", f"checkpoint.save={ckpt}",
                "logger.log_interval=1", "validation.eval_interval=null")
    assert out.termination is not None
    it = out.termination["iteration"]
    assert it is not None and 1 <= it < 1000
    _check_exit_condition(out, ckpt, it)
    assert "exit_duration_in_mins" in caplog.text


def test_losses_are_finite_in_the_pretrained_run(pretrained):
    assert all(math.isfinite(v) for v in pretrained.loss.values())
    assert pretrained.loss[PRE_ITERS] < pretrained.loss[1] - 0.5


# --------------------------------------------------------------------------------------------------
# Evaluation as the reference: validation and test after training, evaluation-only runs
# --------------------------------------------------------------------------------------------------

EVAL_LINE = re.compile(r" validation loss at iteration (\d+) on (validation|test) set \| lm loss value: (\S+) \|"
                       r" lm loss PPL: (\S+) \|")


def final_evaluations(stdout: str) -> dict[str, tuple[int, float]]:
    """{"validation"|"test": (iteration, lm loss)} from the reference's lines printed after training."""
    return {m[2]: (int(m[1]), float(m[3])) for m in EVAL_LINE.finditer(stdout)}


def _forward_step():
    from kubetron.training.gpt_step import forward_step

    return forward_step


def _corpus(tmp_path: Path, name: str, texts: list[str]) -> str:
    from kubetron.data.preprocess import preprocess

    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess([str(path)], str(tmp_path / name), log=lambda m: None)
    return str(tmp_path / name)


def test_validation_and_test_splits_are_evaluated_after_training(tmp_path, capsys):
    """dataset.split's validation and test shares (and train/valid/test_data_path) are evaluated once
    training completes, with the reference's lines and `lm loss validation` / `lm loss test` scalars."""
    rng = np.random.default_rng(0)
    text = _corpus(tmp_path, "text", [f"{i}: " + " ".join(SENTENCES[(i + j) % 4] for j in range(3))
                                      for i in range(200)])
    noise = _corpus(tmp_path, "noise", ["".join(chr(c) for c in rng.integers(33, 127, 300)) for _ in range(50)])
    base = ["train.train_iters=20", "scheduler.lr_warmup_iters=2", "logger.log_interval=10",
            "validation.eval_iters=2"]

    cfg = in_process_config(*base, f"dataset.data_path={text}", "dataset.split=80,10,10",
                            f"logger.tensorboard_dir={tmp_path}/tb1")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    got = final_evaluations(capsys.readouterr().out)
    assert set(got) == {"validation", "test"} and got["validation"][0] == got["test"][0] == 20
    assert tb_scalars(tmp_path / "tb1", "lm loss validation") == {20: pytest.approx(got["validation"][1])}
    assert tb_scalars(tmp_path / "tb1", "lm loss test") == {20: pytest.approx(got["test"][1])}
    assert tb_scalars(tmp_path / "tb1", "lm loss test ppl")[20] == pytest.approx(math.exp(got["test"][1]), rel=1e-5)

    # per-split paths: the test blend is random characters the model never saw, validation is the text
    cfg = in_process_config(*base, f"dataset.train_data_path={text}", f"dataset.valid_data_path={text}",
                            f"dataset.test_data_path={noise}")
    assert run_pretrain(cfg, _forward_step()) == exitcodes.COMPLETED
    got = final_evaluations(capsys.readouterr().out)
    assert got["test"][1] > got["validation"][1] + 1.0, got

    # validation.eval_iters 0: no evaluation at all
    assert run_pretrain(in_process_config(*base[:-1], "validation.eval_iters=0"), _forward_step()) == 0
    assert final_evaluations(capsys.readouterr().out) == {}


def test_evaluation_config_is_checked():
    from kubetron.config import ConfigContainer
    from kubetron.contract.errors import ConfigError

    with pytest.raises(ConfigError, match="validation.eval_iters: 0 turns evaluation off, but "
                                          "validation.eval_interval is set"):
        in_process_config("validation.eval_iters=0", "validation.eval_interval=10")
    with pytest.raises(ConfigError, match="validation.eval_iters: 0 turns evaluation off, but "
                                          "validation.skip_train is set"):
        in_process_config("validation.eval_iters=0", "validation.skip_train=true")
    with pytest.raises(ConfigError, match=r"train.skip_train: unknown key \(did you mean 'validation.skip_train'"):
        ConfigContainer.from_dict({"train": {"train_iters": 5, "skip_train": True}})


def test_skip_train_evaluates_the_checkpoint_and_leaves_the_store_alone(pretrained, tmp_path):
    """validation.skip_train (as the reference): load the checkpoint, no training, the evaluations after
    training from the first sample of each split: the same numbers the training run printed for its
    final model. Nothing is saved, the progress log is untouched, TensorBoard gets the validation and test
    scalars (at the checkpoint's iteration), exit 0 with a termination message that claims no training progress."""
    store = tmp_path / "store"
    shutil.copytree(pretrained.ckpt, store)
    progress = (store / "progress.txt").read_bytes()
    with console() as printed:
        p = drive(tmp_path, "validation.skip_train=true", f"checkpoint.save={store}", f"checkpoint.load={store}",
                  f"logger.tensorboard_dir={tmp_path}/tb", "validation.eval_interval=null",
                  f"train.train_iters={PRE_ITERS + 10}")
    stdout = printed.getvalue()
    assert p.code == 0
    assert "skipping training" in stdout and not re.search(r"iteration\s+\d+/", stdout)
    got = final_evaluations(stdout)
    assert got == final_evaluations(pretrained.stdout) and set(got) == {"validation", "test"}
    assert got["validation"][0] == PRE_ITERS
    assert iter_dirs(store) == ["iter_0000030", "iter_0000040"] and tracker_iteration(store) == PRE_ITERS
    assert (store / "progress.txt").read_bytes() == progress
    assert tb_scalars(tmp_path / "tb", "lm loss validation") == {PRE_ITERS: pytest.approx(got["validation"][1])}
    assert tb_scalars(tmp_path / "tb", "lm loss test") == {PRE_ITERS: pytest.approx(got["test"][1])}
    term = p.termination
    assert term["reason"] == "Completed" and term["iteration"] == PRE_ITERS and term["trainIters"] is None
    assert "evaluation completed" in term["message"]
