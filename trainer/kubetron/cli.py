"""The `kubetron` command.

    kubetron train     --config FILE [section.key=value ...]   pretrain (also under torchrun)
    kubetron finetune  --config FILE [section.key=value ...]   finetune from checkpoint.pretrained_checkpoint
    kubetron config    [--reference] [--config FILE] [overrides ...]
    kubetron progress  STORE [--json]                 a short summary; the progress log's summary as JSON
    kubetron plan      CONFIG --nodes N --gpus-per-node G [--gpu-memory 80GiB] [--json] [--search] [overrides ...]
                       parameters and per-GPU memory estimate; exit 1 when it does not fit (--search: the
                       smallest layout on up to N nodes that fits)
    kubetron preprocess --input FILE [FILE ...] --output-prefix PREFIX
    kubetron inspect-data --config FILE [overrides ...] [--limit N] [--json]
                                                       the fine-tuning examples a run trains on: text with the
                                                       trained spans marked, or ids and loss masks as JSON
    kubetron import-hf HF_DIR OUT                      HF Llama-family model -> kubetron checkpoint
    kubetron export-hf CKPT OUT [--adapter-only] [--max-shard-size 5GB]
                                                       kubetron checkpoint -> HF config.json + safetensors
                                                       (LoRA: merged into the base, or a PEFT adapter)
    kubetron operator  [--namespace NS ...] [--liveness URL] [--peering NAME] [--interval SECONDS]
                       [--metrics-port PORT] [--gang-schedulers volcano,coscheduling,kubernetes|none]
                       [--s3-operator-buckets BUCKET,...] [--taint-failing-nodes]
    kubetron render    FILE
    kubetron submit    FILE [--wait]          create a TrainingJob, follow it until Running (or finished)
    kubetron status    [NAME]                 the kubectl get columns plus reason and last checkpoint
    kubetron logs      NAME [-f] [--rank N]   the current attempt's trainer logs
    kubetron delete    NAME
    (also installed as the kubectl plugin `kubectl-kubetron`: `kubectl kubetron status`)

User errors (bad config, bad command line) print one line, `kubetron: error: <field>: <message>`,
write the termination message and exit 2. Output into a pipe that closed early (`kubetron progress
DIR | head -1`) ends the command quietly with exit 141, what a shell reports for a program killed by
SIGPIPE (as git and kubectl do). Importing this module does not import torch: each command imports
what it needs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kubetron import __version__
from kubetron.client_cli import add_commands
from kubetron.contract import exitcodes
from kubetron.contract.errors import ConfigError

PROG = "kubetron"
CLOSED_PIPE = 141  # 128 + SIGPIPE: the exit status of `cmd | head` for a cmd that SIGPIPE kills


class _UsageError(Exception):
    """An argparse usage error, reported like a ConfigError."""


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (raised, so main() reports them uniformly)."""

    def error(self, message: str):
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _report(field_and_message: str, termination_log: str | None = None) -> int:
    """Print the one-line error, write the termination message, return exit code 2."""
    line = _one_line(field_and_message)
    # One write, not print's two (text, then newline): two ranks reporting the same config error into one
    # pod log must not interleave as "...reference`)kubetron: error: ...".
    sys.stderr.write(f"{PROG}: error: {line}\n")
    sys.stderr.flush()
    from kubetron.supervisor.termination_log import write_termination_message

    write_termination_message({"exitCode": exitcodes.CONFIG_ERROR, "reason": exitcodes.NAMES[exitcodes.CONFIG_ERROR],
                               "message": line}, termination_log)
    return exitcodes.CONFIG_ERROR


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------


def _load_config(args: argparse.Namespace, check_paths: bool = True):
    from kubetron.config import ConfigContainer

    cfg = ConfigContainer.from_yaml(args.config, list(args.overrides), check_paths=check_paths)
    args._cfg = cfg  # lets main() find train.termination_log if a later step fails
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    from kubetron.supervisor.startup import CLOCK

    CLOCK.mark("python + config")
    from kubetron.compat import megatron_core

    megatron_core.install()  # before anything imports megatron-core
    from kubetron.training.entry import run_from_cli

    # The process is the command (not main() called in-process): the SIGTERM handler stays to the end.
    faults, at_step = chaos_from_env(os.environ)
    listeners = [x for x in (events_tap(os.environ), at_step) if x is not None]  # the tap first: it has seen k
    return int(run_from_cli(cfg, mode="finetune" if args.command == "finetune" else "pretrain",
                            keep_signal_handler=args.own_process, faults=faults, listeners=listeners))


EVENTS_FILE_ENV = "KUBETRON_EVENTS_FILE"
TAPPED = ("Started", "PhaseEntered", "PhaseLeft", "StepDone", "SaveScheduled", "CheckpointDurable", "SnapshotWritten",
          "Stopping", "Ended")  # not Progress: a save's many


def events_tap(environ) -> Callable[[object], None] | None:
    """KUBETRON_EVENTS_FILE=<path>, only when asked: the run's events (TAPPED), one JSON line each appended to <path>
    as they happen, `{"event", "iteration", "phase", "time", "pid"}`, for tests and soaks that watch a run from
    outside its process by its own events, not by its printed lines (bench/chaos.py). None when unset."""
    path = environ.get(EVENTS_FILE_ENV)
    if not path:
        return None
    import threading
    import time

    try:
        out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (open for the run; a line per write)
    except OSError as e:
        raise ConfigError(f"env {EVENTS_FILE_ENV}", f"cannot open {path!r}: {e.strerror}") from None
    pid, lock = os.getpid(), threading.Lock()  # (a save's events come from its writer thread too)

    def tap(event: object) -> None:
        name = type(event).__name__
        if name not in TAPPED:
            return
        checkpoint = getattr(event, "checkpoint", None)
        iteration = getattr(event, "iteration", None)
        if iteration is None and checkpoint is not None:
            iteration = checkpoint.iteration
        line = json.dumps({"event": name, "iteration": iteration, "phase": getattr(event, "phase", None),
                           "time": time.time(), "pid": pid}) + "\n"
        with lock:
            out.write(line)

    return tap


CHAOS_KILL_AT_ENV = "KUBETRON_CHAOS_KILL_AT"
CHAOS_RANK_ENV = "KUBETRON_CHAOS_RANK"
CHAOS_SIGNAL_ENV = "KUBETRON_CHAOS_SIGNAL"
CHAOS_ARM_ENV = "KUBETRON_CHAOS_ARM"
CHAOS_SIGNALS = ("KILL", "STOP", "TERM", "INT", "SEGV")


def chaos_from_env(environ) -> tuple[Callable[[str, int], None] | None, Callable[[object], None] | None]:
    """Fault injection, only when asked, for tests and soaks of the real process (no printed line to act on):
    KUBETRON_CHAOS_KILL_AT=<point>[@<iteration>] sends this process KUBETRON_CHAOS_SIGNAL (KILL, the default; STOP,
    TERM, INT or SEGV) at that point: a point of a save (kubetron.checkpoint.manager.SAVE_POINTS: after-shard,
    after-model, after-payload, after-commit, after-tracker, ...) or `step@<k>`, once iteration k is done (a
    listener of the run's StepDone), or `step@<r>%<m>`, at the first iteration i with i % m == r (with
    KUBETRON_CHAOS_ARM: the first once armed). With KUBETRON_CHAOS_RANK=<r> only global rank r (env RANK) is hit.
    A comma-separated list is several faults, in order; KUBETRON_CHAOS_SIGNAL is then one signal for all or one per
    fault.

    Which fault, when: without KUBETRON_CHAOS_ARM, fault i fires only in the worker's life i
    (TORCHELASTIC_RESTART_COUNT, unset: 0), so the ranks torchrun restarts in place run clean (`step@13,step@25`
    with STOP,SEGV: a hang in the first life, a crash in the second). With KUBETRON_CHAOS_ARM=<path>, each fault
    fires once, in order, in whichever life runs then: fault i waits until the file <path>-<i> exists (a test
    arms it when it has done what must come first; the process still acts at its own step, not at a line someone
    read) and marks <path>-<i>.fired as it fires (a restart in place the test did not plan cannot skip it).

    Returns (the checkpoint manager's save-fault hook, the step listener); (None, None) when unset or not this
    rank's or this life's. A malformed value is a ConfigError naming the variable."""
    spec = environ.get(CHAOS_KILL_AT_ENV)
    if not spec:
        return None, None
    from kubetron.checkpoint.manager import SAVE_POINTS

    specs = [one.strip() for one in spec.split(",")]
    step_at: list[tuple[int, int] | None] = []  # a step fault's (r, m): i hits it when i % m == r (m 0: i == r)
    for one in specs:
        point, _, at = one.partition("@")
        residue, _, modulus = at.partition("%")
        if point not in (*SAVE_POINTS, "step") or (at and not residue.isdigit()) or (point == "step" and not at) \
                or (modulus and (point != "step" or not modulus.isdigit() or int(residue) >= int(modulus))):
            raise ConfigError(f"env {CHAOS_KILL_AT_ENV}", f"{one!r} is not <point>[@<iteration>] with a point of "
                              f"{', '.join(SAVE_POINTS)}, step@<iteration> or step@<r>%<m> (0 <= r < m)")
        step_at.append((int(residue), int(modulus or 0)) if point == "step" else None)
    names = [n.strip().upper().removeprefix("SIG") for n in environ.get(CHAOS_SIGNAL_ENV, "KILL").split(",")]
    if len(names) not in (1, len(specs)):
        raise ConfigError(f"env {CHAOS_SIGNAL_ENV}", f"{len(names)} signals for {len(specs)} faults "
                          f"({CHAOS_KILL_AT_ENV}): give one for all or one per fault")
    for name in names:
        if name not in CHAOS_SIGNALS:
            raise ConfigError(f"env {CHAOS_SIGNAL_ENV}", f"{name!r} is not one of {', '.join(CHAOS_SIGNALS)}")
    only = environ.get(CHAOS_RANK_ENV)
    if only and not only.isdigit():
        raise ConfigError(f"env {CHAOS_RANK_ENV}", f"{only!r} is not a rank (a number)")
    if only and int(only) != int(environ.get("RANK", "0") or 0):
        return None, None
    faults = [(one, signal.Signals[f"SIG{names[i if len(names) > 1 else 0]}"]) for i, one in enumerate(specs)]
    armed_by = environ.get(CHAOS_ARM_ENV)
    if armed_by:
        pick = _armed_fault(armed_by, len(faults))
    else:
        life = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if life >= len(faults):
            return None, None
        pick = lambda: life  # noqa: E731

    def hit(i: int) -> None:
        if armed_by:
            Path(f"{armed_by}-{i}.fired").touch()  # before the signal: a STOP or KILL ends what follows
        sys.stdout.flush()
        os.kill(os.getpid(), faults[i][1])

    def at_step(event: object) -> None:
        if not isinstance(event, StepDone) or (i := pick()) is None or (at := step_at[i]) is None:
            return
        residue, modulus = at
        if (event.iteration % modulus if modulus else event.iteration) == residue:
            hit(i)

    def at_save(save_point: str, iteration: int) -> None:
        if (i := pick()) is not None and faults[i][0] in (save_point, f"{save_point}@{iteration}"):
            hit(i)

    from kubetron.events import StepDone

    return (at_save if None in step_at else None), (at_step if step_at.count(None) < len(step_at) else None)


def _armed_fault(path: str, count: int) -> Callable[[], int | None]:
    """With KUBETRON_CHAOS_ARM: the index of the fault that may fire now, in order: the first not fired yet
    (`<path>-<i>.fired`, written as it fires, so a life torchrun restarts in place skips it), once its file
    `<path>-<i>` exists; None when it is not armed yet or all have fired. Checked at each event: a stat or two."""
    fired = [False] * count

    def pick() -> int | None:
        for i in range(count):
            if not fired[i]:
                fired[i] = Path(f"{path}-{i}.fired").exists()
            if not fired[i]:
                return i if Path(f"{path}-{i}").exists() else None
        return None

    return pick


def cmd_config(args: argparse.Namespace) -> int:
    from kubetron.contract.config import config_reference_markdown

    if args.reference:
        if args.config or args.overrides:
            raise _UsageError("--reference takes no --config or overrides")
        sys.stdout.write(config_reference_markdown())
        return 0
    cfg = _load_config(args)
    if not args.no_finalize:
        world_size = args.world_size
        if world_size is None:
            raw = os.environ.get("WORLD_SIZE", "").strip() or "1"
            if not raw.isdigit():
                raise ConfigError("--world-size", f"env WORLD_SIZE={raw!r} is not a positive integer")
            world_size = int(raw)
        cfg.finalize(world_size=world_size)
    sys.stdout.write(cfg.to_yaml())
    return 0


def cmd_progress(args: argparse.Namespace) -> int:
    from kubetron.supervisor.progress_io import format_summary, summarize

    summary = summarize(args.store)
    if args.json:
        print(json.dumps(summary))
    else:
        sys.stdout.write(format_summary(summary))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Parameters and per-GPU memory estimate of CONFIG on nodes x gpus_per_node; exit 1 when it does not fit."""
    from kubetron.config import ConfigContainer
    from kubetron.contract.plan import format_plan, make_plan, parse_memory

    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be >= 1, got {getattr(args, name)}")
    args._cfg = cfg = ConfigContainer.from_yaml(args.config, list(args.overrides), check_paths=False)
    if args.search:
        return _plan_search(args)
    plan = make_plan(cfg, args.nodes * args.gpus_per_node, parse_memory(args.gpu_memory))
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        sys.stdout.write(format_plan(plan, cfg, args.nodes, args.gpus_per_node))
    return 0 if plan.fits else 1


def _plan_search(args: argparse.Namespace) -> int:
    """`plan --search`: the smallest layout (GPUs, TP/PP/DP, recompute) on up to --nodes nodes that fits."""
    from kubetron.config import ConfigContainer
    from kubetron.contract.plan import format_found, gpu_counts, parse_memory, search

    memory = parse_memory(args.gpu_memory)
    found = search(lambda extra: ConfigContainer.from_yaml(args.config, [*args.overrides, *extra], check_paths=False),
                   gpu_counts(args.nodes, args.gpus_per_node), memory)
    if args.json:
        print(json.dumps(None if found is None else {"nodes": found.nodes, "gpus_per_node": found.gpus_per_node,
                                                     "recompute": found.recompute, "overrides": found.overrides,
                                                     **found.plan.to_dict()}))
    else:
        sys.stdout.write(format_found(found, args.nodes, args.gpus_per_node, memory))
    return 0 if found is not None else 1


def cmd_preprocess(args: argparse.Namespace) -> int:
    from kubetron.data.preprocess import run

    run(args)
    return 0


def cmd_inspect_data(args: argparse.Namespace) -> int:
    from kubetron.data.inspect import run

    if args.limit < 0:
        raise ConfigError("--limit", f"must be >= 0, got {args.limit}")
    return run(_load_config(args), args.limit, args.json)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_import_hf(args: argparse.Namespace) -> int:
    from kubetron.hf.io import import_hf, model_yaml

    m = import_hf(args.hf_dir, args.out, progress=_to_stderr)
    print(f"# wrote {args.out}/iter_0000000; fine-tune from it with this in the run config:")
    sys.stdout.write(model_yaml(m, args.out, args.hf_dir))
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from kubetron.contract.plan import parse_size
    from kubetron.hf.io import export_hf

    limit = parse_size(args.max_shard_size, "--max-shard-size", bare_unit=1)
    cfg = export_hf(args.ckpt, args.out, adapter_only=args.adapter_only, max_shard_size=limit, progress=_to_stderr)
    if args.adapter_only:
        print(f"wrote {args.out}: PEFT LoRA adapter, r={cfg['r']}, {', '.join(cfg['target_modules'])}")
        return 0
    print(f"wrote {args.out}: {cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, {cfg['torch_dtype']}")
    return 0


GANG_SCHEDULERS = ("volcano", "coscheduling", "kubernetes")  # spec.scheduling.gang values with a PodGroup


def gang_schedulers(text: str) -> tuple[str, ...]:
    """`--gang-schedulers volcano,coscheduling,kubernetes` (or 'none') -> the names, each checked."""
    names = tuple(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    unknown = [n for n in names if n not in GANG_SCHEDULERS]
    if unknown:
        raise ConfigError("--gang-schedulers",
                          f"{', '.join(unknown)}: must be volcano, coscheduling, kubernetes or none")
    return names


def _operator_part(command: str, module: str, name: str):
    """`name` from the operator's package, or a one-line error where this install has only the trainer."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ConfigError(command, f"needs the operator's packages ({exc.name} is missing): "
                                   "pip install 'kubetron[operator]'") from None


def cmd_operator(args: argparse.Namespace) -> int:
    run = _operator_part("operator", "kubetron_operator.main", "run")
    return int(run(args) or 0)


def cmd_render(args: argparse.Namespace) -> int:
    render_file = _operator_part("render", "kubetron_operator.render", "render_file")
    if not os.path.isfile(args.file):
        raise ConfigError("FILE", f"{args.file}: no such file")
    print(render_file(args.file))
    return 0


# --------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE", help="YAML config file (default: defaults only)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override a config key; the value is parsed as YAML (e.g. train.train_iters=20)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Megatron-Bridge-style GPT trainer and its Kubernetes operator.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    for name, help_text in (("train", "pretrain a GPT model"),
                            ("finetune", "finetune from checkpoint.pretrained_checkpoint")):
        p = sub.add_parser(name, help=help_text, description=f"{help_text[0].upper()}{help_text[1:]}. "
                           "Run under torchrun for more than one rank.")
        _add_config_args(p)
        # torch.distributed.launch passes this; torchrun uses LOCAL_RANK instead. Accepted, ignored.
        p.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
        p.set_defaults(func=cmd_train)

    p = sub.add_parser("config", help="print the resolved config, or the reference of all keys",
                       description="Print the resolved config as YAML (as saved in run_config.yaml), "
                                   "or with --reference the Markdown reference of every key.")
    _add_config_args(p)
    p.add_argument("--reference", action="store_true", help="print the Markdown reference of all sections and keys")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to resolve derived values for (default: $WORLD_SIZE or 1)")
    p.add_argument("--no-finalize", action="store_true", help="print the validated input without derived values")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("progress", help="summarize a store's progress log",
                       description="Parse <STORE>/progress.txt (a directory or s3://bucket/prefix) and print a "
                                   "short summary (iteration, last checkpoint, tokens/s, ETA, restarts), or with "
                                   "--json the whole summary as JSON.")
    p.add_argument("store", metavar="STORE", help="checkpoint store: a directory or s3://bucket/prefix")
    p.add_argument("--json", action="store_true", help="the summary as one line of JSON (every event included)")
    p.set_defaults(func=cmd_progress)

    p = sub.add_parser("plan", help="parameters and per-GPU memory estimate of a config at a GPU count",
                       description="Print the parameters and the per-GPU memory estimate (weights, gradients, "
                                   "optimizer state, activations with and without recompute) of CONFIG on "
                                   "NODES x GPUS_PER_NODE GPUs, and whether it fits --gpu-memory. Exit 0: fits; "
                                   "1: does not fit; 2: a config error. Tokenizer and data files are not read "
                                   "(set model.vocab_size for file-based tokenizers).")
    p.add_argument("config", metavar="CONFIG", help="YAML config file (e.g. recipes/llama3.1-8b-pretrain.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override a config key")
    p.add_argument("--nodes", type=int, required=True, help="nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node")
    p.add_argument("--gpu-memory", default="80GiB", metavar="SIZE",
                   help="memory of one GPU: 80GiB, 141GB, ... (a bare number is GiB; default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the plan as one line of JSON (bytes)")
    p.add_argument("--search", action="store_true",
                   help="find the smallest layout that fits instead: fewest GPUs (parts of a node, then 1..NODES "
                        "nodes of GPUS_PER_NODE), then recompute off/selective/full, then fewest TP x PP; exit 1 when "
                        "none does")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("preprocess", help="tokenize text/JSONL into an indexed dataset (.bin/.idx)",
                       description="Tokenize text or JSONL files with any of the trainer's tokenizers into "
                                   "PREFIX.bin and PREFIX.idx (usable as dataset.data_path).")
    from kubetron.data.preprocess import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_preprocess)

    p = sub.add_parser("inspect-data", help="show the fine-tuning examples a config trains on (tokens, loss mask)",
                       description="Build the finetuning section's training data as the trainer would (template, "
                                   "truncation, packing), in memory, and print the data line and the first examples "
                                   "with their trained spans between ⟦ and ⟧; --json: one object per example with "
                                   "\"ids\" and \"loss_mask\" (1 where the id is a trained target). No GPU, nothing "
                                   "written.")
    _add_config_args(p)
    p.add_argument("--limit", type=int, default=5, metavar="N", help="examples to show (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object per example (the data line to stderr)")
    p.set_defaults(func=cmd_inspect_data)

    p = sub.add_parser("import-hf", help="convert a Hugging Face Llama-family model into a kubetron checkpoint",
                       description="Convert HF_DIR (config.json + model.safetensors, or the shards "
                                   "model.safetensors.index.json lists, of a Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE "
                                   "or Mixtral model; never pytorch_model.bin) into the kubetron checkpoint OUT and "
                                   "print the matching model section.")
    p.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face model directory")
    p.add_argument("out", metavar="OUT", help="checkpoint directory to create (a path or s3://bucket/prefix)")
    p.set_defaults(func=cmd_import_hf)

    p = sub.add_parser("export-hf", help="write a kubetron checkpoint as a Hugging Face model",
                       description="Write OUT/config.json and OUT/model.safetensors, or its shards with an index "
                                   "(and the tokenizer files the checkpoint holds, its chat template included) from "
                                   "the newest checkpoint in CKPT, for transformers.")
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory (or one iter_ directory, or s3://...)")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--adapter-only", action="store_true",
                   help="a LoRA checkpoint: write its adapter in PEFT's format (adapter_config.json + "
                        "adapter_model.safetensors, with the tokenizer files) instead of weights merged into the base")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest weight file: more is written as model-0000i-of-0000n.safetensors shards with "
                        "model.safetensors.index.json, as transformers' save_pretrained (5GB, 500MB, 2GiB; a bare "
                        "number is bytes; default: %(default)s)")
    p.set_defaults(func=cmd_export_hf)

    p = sub.add_parser("operator", help="run the Kubernetes operator",
                       description="Run the kubetron operator (kopf) against the current cluster.")
    p.add_argument("--namespace", "-n", action="append", default=None, metavar="NS",
                   help="namespace to watch (repeatable; default: all namespaces)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                   help="kopf's liveness endpoint (default: %(default)s; '' turns it off)")
    p.add_argument("--peering", default=None, metavar="NAME", help="kopf peering object name (for HA operators)")
    p.add_argument("--interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between live-progress reads of a running job; changes to a job or its "
                   "pods are handled as they happen (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve Prometheus metrics on this port at /metrics (default: off)")
    p.add_argument("--taint-failing-nodes", action="store_true",
                   help="taint a node cluster-wide (kubetron.dev/failing-node=<namespace>:NoSchedule) when a job "
                        "failed on it while it reported a problem itself, or jobs of two namespaces avoid it; never a "
                        "control-plane node, one taint per namespace at a time, removed after --taint-seconds; the "
                        "operator's role must allow get and patch on nodes (the chart's failingNodes.taint)")
    p.add_argument("--taint-seconds", type=int, default=3600, metavar="SECONDS",
                   help="how long a taint of --taint-failing-nodes stays before the operator removes it "
                        "(default: %(default)s)")
    p.add_argument("--gang-schedulers", default=",".join(GANG_SCHEDULERS), metavar="LIST",
                   help="the gang schedulers whose PodGroups the operator may create (its role grants them): "
                   "comma-separated volcano, coscheduling, kubernetes, or 'none'; a job asking for another fails with "
                   "a status saying so, and no PodGroup API is called (default: %(default)s)")
    p.add_argument("--s3-operator-buckets", default="", metavar="LIST",
                   help="S3 buckets (comma-separated) whose jobs without storage.s3.secretRef the operator reads "
                   "with its own identity, at its own endpoint (the chart's operatorS3Buckets); other such jobs' "
                   "stores are not read by the operator (default: none)")
    p.set_defaults(func=cmd_operator)

    p = sub.add_parser("render", help="print the Kubernetes objects for a TrainingJob manifest",
                       description="Render a TrainingJob manifest into the objects the operator would create.")
    p.add_argument("file", metavar="FILE", help="TrainingJob YAML manifest")
    p.set_defaults(func=cmd_render)

    add_commands(sub, _Parser)  # submit/status/logs/delete: kubetron.client (no torch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kubetron` command; returns the exit code (2 for user errors, 141 for a closed pipe).

    `argv` None: this process is the command (the console script, `python -m kubetron`), its
    arguments in sys.argv; it exits with the code returned, so what it installs (train's SIGTERM
    handler) may stay until then. A list: an in-process call, which leaves the process as it was.
    """
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        _silence_stdout()
        return CLOSED_PIPE


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's exit flushes what is left without an error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # not a real file (captured)
        pass


def _main(argv: Sequence[str] | None) -> int:
    own_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = None
    try:
        args, extras = parser.parse_known_args(argv)
        args.own_process = own_process
        if extras:
            if args.command not in ("train", "finetune", "config", "plan", "inspect-data"):
                parser.error(f"unrecognized arguments: {' '.join(extras)}")
            # Overrides may come before and after options: `train a.b=1 --config f c.d=2`.
            args.overrides = list(args.overrides) + extras
        if args.command == "preprocess" and args.workers < 1:
            raise ConfigError("--workers", f"must be >= 1, got {args.workers}")
        if args.command == "operator" and not args.interval > 0:
            raise ConfigError("--interval", f"must be > 0 seconds, got {args.interval}")
        if args.command == "operator" and not 0 <= args.metrics_port <= 65535:
            raise ConfigError("--metrics-port", f"must be a port number (0 = off), got {args.metrics_port}")
        if args.command == "operator":
            args.gang_schedulers = gang_schedulers(args.gang_schedulers)
            args.s3_operator_buckets = tuple(b.strip() for b in args.s3_operator_buckets.split(",") if b.strip())
        return int(args.func(args) or 0)
    except ConfigError as exc:
        cfg = getattr(args, "_cfg", None)
        path = getattr(getattr(cfg, "train", None), "termination_log", None)
        return _report(f"{exc.field}: {exc.message}", path)
    except _UsageError as exc:
        return _report(str(exc))
