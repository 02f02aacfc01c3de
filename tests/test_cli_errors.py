"""Malformed configs and command lines: exit code 2, one line on stderr naming the field, no traceback.

Most cases run `kubetron.cli.main` in-process (fast); a handful run the real command line in a
subprocess, which also proves validation fails before torch is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from kubetron.cli import main

pytestmark = pytest.mark.unit

# (id, yaml text or None for no --config, extra argv, field the error must name)
CASES = [
    ("missing-file", "@missing", [], "--config"),
    ("bad-yaml", "train:\n  train_iters: [1, 2\n", [], "--config"),
    ("top-level-list", "- a\n- b\n", [], "--config"),
    ("unknown-section", "trian:\n  train_iters: 5\n", [], "trian.train_iters"),
    ("unknown-key", "train:\n  train_iter: 5\n", [], "train.train_iter"),
    ("top-level-key", "train_iters: 5\n", [], "train_iters"),
    ("key-in-wrong-section", "train:\n  train_iters: 5\n  lr: 0.1\n", [], "train.lr"),
    ("section-not-mapping", "train: 5\n", [], "train"),
    ("not-an-integer", "train:\n  train_iters: 5\n  micro_batch_size: abc\n", [], "train.micro_batch_size"),
    ("negative-iters", "train:\n  train_iters: -5\n", [], "train.train_iters"),
    ("no-length", "model:\n  num_layers: 2\n", [], "train.train_iters"),
    ("iters-and-samples", "train:\n  train_iters: 5\n  train_samples: 100\n", [], "train.train_samples"),
    ("bad-literal", "train: {train_iters: 5}\nmodel: {position_embedding_type: sinusoid}\n", [],
     "model.position_embedding_type"),
    ("hidden-not-div-heads", "train: {train_iters: 5}\nmodel: {hidden_size: 66, num_attention_heads: 4}\n", [],
     "model.hidden_size"),
    ("heads-not-div-tp", "train: {train_iters: 5}\nmodel: {num_attention_heads: 4, tensor_model_parallel_size: 3}\n",
     [], "model.num_attention_heads"),
    ("layers-not-div-pp", "train: {train_iters: 5}\nmodel: {num_layers: 3, pipeline_model_parallel_size: 2}\n", [],
     "model.num_layers"),
    ("gbs-not-div-mbs", "train: {train_iters: 5, micro_batch_size: 4, global_batch_size: 10}\n", [],
     "train.global_batch_size"),
    ("bf16-and-fp16", "train: {train_iters: 5}\nmixed_precision: {bf16: true, fp16: true}\n", [],
     "mixed_precision.fp16"),
    ("dropout-out-of-range", "train: {train_iters: 5}\nmodel: {hidden_dropout: 1.5}\n", [], "model.hidden_dropout"),
    ("min-lr-above-lr", "train: {train_iters: 5}\noptimizer: {lr: 0.001, min_lr: 0.01}\n", [], "optimizer.min_lr"),
    ("null-tokenizer-no-vocab", "train: {train_iters: 5}\ntokenizer: {tokenizer_type: 'null'}\n", [],
     "tokenizer.vocab_size"),
    ("bad-split", "train: {train_iters: 5}\ndataset: {split: 'a,b'}\n", [], "dataset.split"),
    ("wsd-needs-decay-iters", "train: {train_iters: 5}\nscheduler: {lr_decay_style: WSD}\n", [],
     "scheduler.lr_wsd_decay_iters"),
    ("eval-interval-zero", "train: {train_iters: 5}\nvalidation: {eval_interval: 0}\n", [],
     "validation.eval_interval"),
    ("bad-exit-signal", "train: {train_iters: 5, exit_signal: SIGFOO}\n", [], "train.exit_signal"),
    ("bad-logging-level", "train: {train_iters: 5}\nlogger: {logging_level: LOUD}\n", [], "logger.logging_level"),
    ("log-interval-zero", "train: {train_iters: 5}\nlogger: {log_interval: 0}\n", [], "logger.log_interval"),
    ("most-recent-k-zero", "train: {train_iters: 5}\ncheckpoint: {most_recent_k: 0}\n", [],
     "checkpoint.most_recent_k"),
    ("status-port-range", "train: {train_iters: 5, status_port: 70000}\n", [], "train.status_port"),
    ("local-ckpt-needs-dir", "train: {train_iters: 5}\ncheckpoint: {non_persistent_ckpt_type: local}\n", [],
     "checkpoint.non_persistent_local_ckpt_dir"),
    ("missing-data", "train: {train_iters: 5}\ndataset: {data_path: [/nonexistent/corpus]}\n", [],
     "dataset.data_path"),
    ("missing-pretrained", "train: {train_iters: 5}\ncheckpoint: {pretrained_checkpoint: /nonexistent/ckpt}\n", [],
     "checkpoint.pretrained_checkpoint"),
    ("missing-tokenizer", "train: {train_iters: 5}\ntokenizer: {tokenizer_type: HuggingFaceTokenizer, "
     "tokenizer_model: /nonexistent/llama}\n", [], "tokenizer.tokenizer_model"),  # read at start, not at admission
    ("weights-unpaired", "train: {train_iters: 5}\ndataset: {data_path: ['0.5', a, '0.5']}\n", [],
     "dataset.data_path"),
    # overrides
    ("override-no-equals", None, ["train.train_iters=5", "foo"], "override 'foo'"),
    ("override-no-section", None, ["train_iters=5"], "override 'train_iters=5'"),
    ("override-unknown-section", None, ["train.train_iters=5", "optimzer.lr=0.1"], "optimzer.lr"),
    ("override-unknown-key", None, ["train.train_iterz=5"], "train.train_iterz"),
    ("override-bad-number", None, ["train.train_iters=5", "optimizer.lr=fast"], "optimizer.lr"),
    ("override-bad-list", None, ["train.train_iters=5", "train.iterations_to_skip=[1,"], "train.iterations_to_skip"),
    ("override-negative-skip", None, ["train.train_iters=5", "train.iterations_to_skip=[-1]"],
     "train.iterations_to_skip"),
    ("override-bad-bool", None, ["train.train_iters=5", "train.manual_gc=maybe"], "train.manual_gc"),
    ("override-string-for-list", None, ["train.train_iters=5", "train.iterations_to_skip=3"],
     "train.iterations_to_skip"),
]

# Errors only finalize() (world size) can find: through `kubetron config --world-size N`.
FINALIZE_CASES = [
    ("world-not-div-mp", "train: {train_iters: 5}\nmodel: {tensor_model_parallel_size: 2}\n", ["--world-size", "3"],
     "model.tensor_model_parallel_size"),
    ("gbs-not-div-dp", "train: {train_iters: 5, micro_batch_size: 2, global_batch_size: 10}\n",
     ["--world-size", "2"], "train.global_batch_size"),
    ("warmup-too-long", "train: {train_iters: 5}\nscheduler: {lr_warmup_iters: 5}\n", [],
     "scheduler.lr_warmup_iters"),
    ("samples-below-gbs", "train: {train_samples: 3, global_batch_size: 4, micro_batch_size: 4}\n", [],
     "train.train_samples"),
]


def _argv(tmp_path, command, text, extra):
    argv = [command]
    if text == "@missing":
        argv += ["--config", str(tmp_path / "does-not-exist.yaml")]
    elif text is not None:
        path = tmp_path / "config.yaml"
        path.write_text(text)
        argv += ["--config", str(path)]
    return argv + list(extra)


def _check(rc, err, field):
    lines = err.splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].strip(), f"expected one line, got {err!r}"
    assert lines[0].startswith(f"kubetron: error: {field}"), lines[0]
    assert "Traceback" not in err


@pytest.fixture(autouse=True)
def _no_termination_log(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBETRON_TERMINATION_LOG", str(tmp_path / "termination-log"))


@pytest.mark.parametrize("command", ["train", "finetune"])
@pytest.mark.parametrize("name, text, extra, field", CASES, ids=[c[0] for c in CASES])
def test_in_process(tmp_path, capsys, command, name, text, extra, field):
    rc = main(_argv(tmp_path, command, text, extra))
    out, err = capsys.readouterr()
    _check(rc, err, field)
    assert out == ""
    # the termination message carries the same line
    msg = json.loads((tmp_path / "termination-log").read_text())
    assert msg["exitCode"] == 2 and msg["reason"] == "ConfigError"
    assert msg["message"] == err.strip().removeprefix("kubetron: error: ")


@pytest.mark.parametrize("name, text, extra, field", FINALIZE_CASES, ids=[c[0] for c in FINALIZE_CASES])
def test_finalize_errors_via_config_command(tmp_path, capsys, name, text, extra, field):
    rc = main(_argv(tmp_path, "config", text, extra))
    _, err = capsys.readouterr()
    _check(rc, err, field)


def test_batch_size_message(tmp_path, capsys):
    text = "train: {train_iters: 5, micro_batch_size: 2, global_batch_size: 10}\n"
    main(_argv(tmp_path, "config", text, ["--world-size", "2"]))
    assert capsys.readouterr().err.strip() == ("kubetron: error: train.global_batch_size: 10 is not divisible by "
                                               "micro_batch_size*data_parallel_size = 4")


def test_suggestions(tmp_path, capsys):
    main(["train", "train.train_iter=5"])
    assert "did you mean 'train.train_iters'?" in capsys.readouterr().err
    main(["train", "trian.train_iters=5"])
    assert "unknown section 'trian' (did you mean 'train'?)" in capsys.readouterr().err
    main(["train", "train.lr=0.1"])
    assert "did you mean 'optimizer.lr'?" in capsys.readouterr().err


def test_bad_yaml_reports_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  train_iters: 5\n  micro_batch_size: [1\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "line " in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    [],
    ["trian"],
    ["train", "--config"],
    ["train", "--bogus-flag"],
    ["progress"],
    ["progress", "store", "extra"],
    ["preprocess", "--input", "x"],
    ["preprocess", "--input", "x", "--output-prefix", "y", "--workers", "many"],
    ["render"],
])
def test_usage_errors(capsys, argv):
    rc = main(argv)
    _, err = capsys.readouterr()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("kubetron: error: ")
    assert "Traceback" not in err


def test_help_exits_zero(capsys):
    for argv in (["--help"], ["train", "--help"], ["config", "--help"], ["progress", "--help"],
                 ["preprocess", "--help"], ["operator", "--help"], ["render", "--help"], ["finetune", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    assert "section.key=value" in capsys.readouterr().out


def test_config_command_prints_resolved_yaml(capsys):
    assert main(["config", "--config", "examples/tiny-gpt.yaml", "--world-size", "2", "train.micro_batch_size=2"]) == 0
    out = capsys.readouterr().out
    assert "num_microbatches: 2" in out and "data_parallel_size: 2" in out


def test_config_reference(capsys):
    assert main(["config", "--reference"]) == 0
    assert "| `train_iters` |" in capsys.readouterr().out


# ---- the real command line ------------------------------------------------------------------------

SUBPROCESS_CASES = [c for c in CASES if c[0] in {
    "missing-file", "bad-yaml", "unknown-key", "not-an-integer", "override-no-equals", "missing-data",
    "missing-tokenizer"}]


def _run(args, env_extra=None, cwd=None):
    env = dict(os.environ)
    env.pop("KUBETRON_TERMINATION_LOG", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "kubetron", *args], check=False, capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=60)


@pytest.mark.parametrize("name, text, extra, field", SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES])
@pytest.mark.process
def test_subprocess(tmp_path, name, text, extra, field):
    log = tmp_path / "termination-log"
    proc = _run(_argv(tmp_path, "train", text, extra), {"KUBETRON_TERMINATION_LOG": str(log)})
    _check(proc.returncode, proc.stderr, field)
    assert proc.stdout == ""
    msg = json.loads(log.read_text())
    assert msg == {"exitCode": 2, "reason": "ConfigError",
                   "message": proc.stderr.strip().removeprefix("kubetron: error: ")}


@pytest.mark.process
def test_cli_does_not_import_torch():
    code = textwrap.dedent("""
        import sys
        from kubetron.cli import main
        rc = main(["train", "train.train_iters=oops"])
        assert rc == 2, rc
        bad = [m for m in ("torch", "megatron", "numpy") if m in sys.modules]
        assert not bad, bad
    """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ---- output into a closed pipe (`kubetron progress DIR | head -1`) ---------------------------------

def _into_closed_pipe(args: list[str], cwd=None) -> subprocess.CompletedProcess:
    """Run `kubetron ARGS` with stdout a pipe whose reader has already gone, as `| head -1` leaves it
    once head has its line: every write fails with EPIPE, deterministically."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "kubetron", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=60, cwd=cwd, check=False)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [
    ["progress", "{tmp}"],                       # a few hundred bytes: fails at the final flush
    ["progress", "{tmp}", "--json"],
    ["config", "--reference"],                   # tens of KB: fails mid-write
    ["config", "--config", "examples/tiny-gpt.yaml"],
], ids=["progress", "progress-json", "config-reference", "config"])
@pytest.mark.process
def test_closed_pipe_ends_quietly_with_141(tmp_path, args):
    """No traceback and no 'Exception ignored' for a reader that left; the status a shell gives a
    program killed by SIGPIPE (git, kubectl), so `set -o pipefail` still sees the output was cut."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = _into_closed_pipe([a.format(tmp=tmp_path) for a in args], cwd=root)
    assert proc.stderr == "" and proc.returncode == 141, (proc.returncode, proc.stderr)


@pytest.mark.parametrize("env, field", [
    ({"KUBETRON_CHAOS_KILL_AT": "mid-step"}, "env KUBETRON_CHAOS_KILL_AT"),
    ({"KUBETRON_CHAOS_KILL_AT": "step"}, "env KUBETRON_CHAOS_KILL_AT"),  # a step needs its iteration
    ({"KUBETRON_CHAOS_KILL_AT": "after-shard@x"}, "env KUBETRON_CHAOS_KILL_AT"),
    ({"KUBETRON_CHAOS_KILL_AT": "step@3", "KUBETRON_CHAOS_SIGNAL": "HUP"}, "env KUBETRON_CHAOS_SIGNAL"),
    ({"KUBETRON_CHAOS_KILL_AT": "step@3,stepp@5"}, "env KUBETRON_CHAOS_KILL_AT"),  # each fault of the list
    ({"KUBETRON_CHAOS_KILL_AT": "step@3,step@5", "KUBETRON_CHAOS_SIGNAL": "STOP,SEGV,KILL"},
     "env KUBETRON_CHAOS_SIGNAL"),  # one signal for all, or one per fault
    ({"KUBETRON_CHAOS_KILL_AT": "step@3,step@5", "KUBETRON_CHAOS_SIGNAL": "STOP,HUP"}, "env KUBETRON_CHAOS_SIGNAL"),
    ({"KUBETRON_CHAOS_KILL_AT": "step@10%10"}, "env KUBETRON_CHAOS_KILL_AT"),  # a residue below its modulus
    ({"KUBETRON_CHAOS_KILL_AT": "step@3%x"}, "env KUBETRON_CHAOS_KILL_AT"),
    ({"KUBETRON_CHAOS_KILL_AT": "after-commit@3%10"}, "env KUBETRON_CHAOS_KILL_AT"),  # only steps take one
    ({"KUBETRON_CHAOS_KILL_AT": "step@3", "KUBETRON_CHAOS_RANK": "one"}, "env KUBETRON_CHAOS_RANK"),
])
def test_a_malformed_fault_request_names_its_variable(env, field):
    from kubetron.cli import chaos_from_env
    from kubetron.contract.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        chaos_from_env(env)
    assert e.value.field == field


def test_the_fault_hooks_hit_only_their_rank_their_point_and_a_first_life(monkeypatch):
    """KUBETRON_CHAOS_KILL_AT: `step@k` is a listener of the run's StepDone(k), a save point the checkpoint
    manager's hook; the signal is KUBETRON_CHAOS_SIGNAL's; only KUBETRON_CHAOS_RANK's rank, only before torchrun
    restarted the worker in place."""
    import signal

    from kubetron import cli
    from kubetron.events import StepDone

    sent: list[int] = []
    monkeypatch.setattr(cli.os, "kill", lambda pid, sig: sent.append(sig))
    step = {"KUBETRON_CHAOS_KILL_AT": "step@3", "KUBETRON_CHAOS_SIGNAL": "sigstop", "KUBETRON_CHAOS_RANK": "1"}
    assert cli.chaos_from_env({}) == (None, None)
    assert cli.chaos_from_env({**step, "RANK": "0"}) == (None, None)
    assert cli.chaos_from_env({**step, "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"}) == (None, None)
    faults, listener = cli.chaos_from_env({**step, "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert faults is None and listener is not None
    for it in (2, 3, 4):
        listener(StepDone(it, 0.1, 8 * it, {}, 1e-3, None, False, None, 1.0))
    assert sent == [signal.SIGSTOP]
    faults, listener = cli.chaos_from_env({"KUBETRON_CHAOS_KILL_AT": "after-commit@20"})
    assert listener is None
    faults("after-commit", 10)
    faults("after-payload", 20)
    faults("after-commit", 20)
    assert sent == [signal.SIGSTOP, signal.SIGKILL]


def test_a_list_of_faults_is_one_per_life_of_the_worker(monkeypatch):
    """`step@13,step@25` with signals STOP,SEGV: the worker's first life hangs at 13, the life torchrun restarts it
    into crashes at 25, a third life runs clean (the hang story on the real control plane acts so)."""
    import signal

    from kubetron import cli
    from kubetron.events import StepDone

    sent: list[int] = []
    monkeypatch.setattr(cli.os, "kill", lambda pid, sig: sent.append(sig))
    env = {"KUBETRON_CHAOS_KILL_AT": "step@13, step@25", "KUBETRON_CHAOS_SIGNAL": "STOP,SEGV"}
    for life in ("0", "1", "2"):
        faults, listener = cli.chaos_from_env({**env, "TORCHELASTIC_RESTART_COUNT": life})
        if life == "2":
            assert (faults, listener) == (None, None)
            continue
        for it in range(10, 30):
            listener(StepDone(it, 0.1, 8 * it, {}, 1e-3, None, False, None, 1.0))
    assert sent == [signal.SIGSTOP, signal.SIGSEGV]
    faults, _ = cli.chaos_from_env({"KUBETRON_CHAOS_KILL_AT": "after-payload,after-commit@20",
                                    "TORCHELASTIC_RESTART_COUNT": "1"})  # one signal (KILL) for all
    faults("after-payload", 20)
    faults("after-commit", 20)
    assert sent == [signal.SIGSTOP, signal.SIGSEGV, signal.SIGKILL]


def test_an_armed_fault_waits_for_its_file_then_hits_at_its_own_step(monkeypatch, tmp_path):
    """KUBETRON_CHAOS_ARM: fault i waits for <path>-<i>; `step@3%10` then hits at the next iteration that is 3 past
    a multiple of 10 (mid-interval, wherever the test armed it); each fault fires once, in order, in whichever life
    runs then (<path>-<i>.fired), so a life torchrun restarted in place unplanned neither skips nor repeats one."""
    import signal

    from kubetron import cli
    from kubetron.events import StepDone

    sent: list[tuple[int, int]] = []
    done = lambda it: StepDone(it, 0.1, 8 * it, {}, 1e-3, None, False, None, 1.0)  # noqa: E731
    arm = tmp_path / "arm"
    env = {"KUBETRON_CHAOS_KILL_AT": "step@3%10,step@5%10", "KUBETRON_CHAOS_SIGNAL": "STOP,SEGV",
           "KUBETRON_CHAOS_ARM": str(arm)}
    it = 0
    monkeypatch.setattr(cli.os, "kill", lambda pid, sig: sent.append((sig, it)))
    _, first = cli.chaos_from_env({**env, "TORCHELASTIC_RESTART_COUNT": "2"})  # restarted before: still armed
    for it in range(1, 25):
        first(done(it))
        if it == 14:
            (tmp_path / "arm-0").touch()
    assert sent == [(signal.SIGSTOP, 23)] and (tmp_path / "arm-0.fired").exists()
    _, second = cli.chaos_from_env({**env, "TORCHELASTIC_RESTART_COUNT": "3"})  # the next life: fault 0 is done
    for it in range(25, 34):
        second(done(it))
    assert sent == [(signal.SIGSTOP, 23)]  # fault 1 not armed yet
    (tmp_path / "arm-1").touch()
    for it in range(34, 60):
        second(done(it))
    assert sent == [(signal.SIGSTOP, 23), (signal.SIGSEGV, 35)]  # once
    _, third = cli.chaos_from_env({**env, "TORCHELASTIC_RESTART_COUNT": "4"})
    for it in range(60, 80):
        third(done(it))
    assert len(sent) == 2


def test_the_events_tap_writes_one_line_per_event_of_the_run(tmp_path):
    """KUBETRON_EVENTS_FILE: the run's events as JSON lines (what bench/chaos.py watches instead of printed lines);
    a save's many Progress events are left out; unset, no listener at all."""
    import json

    from kubetron import cli
    from kubetron.events import (
        PROGRESS,
        Checkpoint,
        CheckpointDurable,
        PhaseEntered,
        SaveScheduled,
        Started,
        StepDone,
    )

    assert cli.events_tap({}) is None
    path = tmp_path / "events.jsonl"
    tap = cli.events_tap({"KUBETRON_EVENTS_FILE": str(path)})
    for event in (Started(20, 100, 160, 0.0, Checkpoint(20, None)), PhaseEntered("train"), PROGRESS,
                  StepDone(21, 0.1, 168, {}, 1e-3, None, False, None, 1.0), SaveScheduled(21),
                  CheckpointDurable(Checkpoint(21, "t"), 0.0, {}, 1.0, 0.1, True)):
        tap(event)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["iteration"], e["phase"]) for e in lines] == [
        ("Started", 20, None), ("PhaseEntered", None, "train"), ("StepDone", 21, None), ("SaveScheduled", 21, None),
        ("CheckpointDurable", 21, None)]
    assert all(e["pid"] == os.getpid() and e["time"] > 0 for e in lines)
    from kubetron.contract.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        cli.events_tap({"KUBETRON_EVENTS_FILE": str(tmp_path / "no-such-dir" / "events.jsonl")})
    assert e.value.field == "env KUBETRON_EVENTS_FILE"
