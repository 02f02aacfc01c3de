"""pretrain() / finetune(): set up distributed state, model, data, checkpoints; run train().

`run_from_cli` is what `kubetron train|finetune` calls: it maps every way a run can end onto the
exit codes of kubetron/contract/exitcodes.py and writes the termination message the operator reads.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from kubetron.compat import megatron_core
from kubetron.contract import exitcodes
from kubetron.contract.errors import CheckpointError, ConfigError, ResumeMismatchError
from kubetron.events import Ended, Events, Listener, Stopping
from kubetron.supervisor.startup import CLOCK
from kubetron.supervisor.termination_log import TerminationReport
from kubetron.training.state import GlobalState, SignalHandler, Timers

if TYPE_CHECKING:
    from kubetron.checkpoint.manager import SaveFaults
    from kubetron.training.run import Run

log = logging.getLogger("kubetron")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_distributed(cfg) -> tuple[int, int, torch.device]:
    """torchrun's env (or MASTER_ADDR/RANK/WORLD_SIZE from the operator); else a world of one. The device and
    the backend are the config's (dist.use_gpu, dist.distributed_backend), resolved here once if unset."""
    cfg.dist.resolve_device(torch.cuda.is_available())
    timeout = timedelta(minutes=cfg.dist.distributed_timeout_minutes)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(cfg.dist.distributed_backend, timeout=timeout)
        else:
            dist.init_process_group(cfg.dist.distributed_backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.dist.use_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return rank, world, device


_PEER_FAILURE_MARKERS = ("connection reset by peer", "connection closed by peer", "timed out waiting",
                         "broken pipe", "connection refused", "socket timeout", "gloo/transport",
                         "nccl communicator was aborted", "watchdog caught collective operation timeout")


def is_peer_failure(exc: BaseException) -> bool:
    """A collective/p2p failure because another rank died or stopped answering (exit code 5).

    gloo raises a plain RuntimeError: at once with "Connection reset by peer"/"Connection closed by
    peer" when a peer process dies, or "Timed out waiting ...ms" after dist.distributed_timeout_minutes
    when it hangs. NCCL and the TCP store raise DistBackendError/DistNetworkError/DistStoreError.
    """
    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _PEER_FAILURE_MARKERS)


def set_seeds(cfg):
    """Megatron's scheme: seed + 100 * pipeline rank (+ 10 * DP rank with data_parallel_random_init)."""
    from megatron.core import parallel_state, tensor_parallel

    seed = cfg.rng.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if cfg.rng.data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


class _Process(NamedTuple):
    state: GlobalState
    rank: int
    world_size: int
    device: torch.device
    start_time: float


def _start(cfg, finalized: bool) -> _Process:
    """This process's part of the job: the process groups, the model-parallel groups, the seeds, and the
    state the forward step is handed. `finalized`: the caller finalized the config (the CLI, before the slow
    imports); else it is finalized here, once, for the world size found."""
    from megatron.core import parallel_state

    from kubetron.checkpoint.manager import adopt_checkpoint_tokenizer

    start_time = time.time()
    rank, world, device = initialize_distributed(cfg)
    if not finalized:
        if cfg.tokenizer.assets() is None and adopt_checkpoint_tokenizer(cfg) and rank == 0:
            log.info("tokenizer: %s from the checkpoint being resumed", cfg.tokenizer.tokenizer_type)
        cfg.finalize(world_size=world)
    apply_logging_level(cfg, rank)
    if parallel_state.model_parallel_is_initialized():  # a second pretrain() in one process
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(cfg.model.tensor_model_parallel_size,
                                             cfg.model.pipeline_model_parallel_size,
                                             expert_model_parallel_size=cfg.model.expert_model_parallel_size,
                                             distributed_timeout_minutes=cfg.dist.distributed_timeout_minutes)
    if rank == 0:
        cfg.log_non_default_values(log)
    set_seeds(cfg)
    CLOCK.mark("distributed init")  # waits for every rank
    state = GlobalState(cfg=cfg, timers=Timers(cfg.logger.timing_log_level))
    return _Process(state, rank, world, device, start_time)


def _run(config, forward_step_func, mode: str, *, listeners: Sequence[Listener] = (),
         signals: SignalHandler | None = None, faults: SaveFaults | None = None, finalized: bool = False,
         **non_loss) -> int:
    """One run in this process, from its start to its end; returns the exit code or raises. Every ending, a
    raise included, reaches the listeners as `Ended` (`Stopping` first once the loop ran). `signals`: the
    handler the run stops on (the caller keeps it; None: one of its own when train.exit_signal_handler is set);
    `faults`: the checkpoint manager's hook at each point of a save."""
    from kubetron.training.run import build_run

    CLOCK.mark("imports")
    cfg = config
    events = Events(listeners)
    own_handler = signals is None and cfg.train.exit_signal_handler
    process = None
    try:
        process = _start(cfg, finalized)
        if own_handler:
            signals = SignalHandler(exit_signals(cfg))
        run = build_run(process.state, events, rank=process.rank, world_size=process.world_size,
                        device=process.device, from_pretrained=mode == "finetune"
                        or bool(cfg.checkpoint.pretrained_checkpoint),
                        signals=signals if cfg.train.exit_signal_handler else None, faults=faults,
                        start_time=process.start_time)
    except Exception as e:
        _let_go_of(signals, own_handler)
        ending = ending_of(e, signals)
        events.emit(Ended(ending.code, ending.message, process.state.train_state.step if process else None))
        raise
    return _train_then_close(run, forward_step_func, own_handler, non_loss)


def _train_then_close(run: Run, forward_step_func, own_handler: bool, non_loss) -> int:
    """Started, the loop (and the evaluation after it), Stopping, teardown, Ended."""
    events, cfg = run.events, run.state.cfg
    events.emit(run.started())
    ending = Ending(exitcodes.ERROR, "", True)
    profiler = make_profiler(cfg, run.rank, run.state.train_state.step)
    failed = True
    try:
        if profiler is not None:
            profiler.start()
        ending = _train_then_evaluate(forward_step_func, run, profiler, non_loss)
        failed = False
    except Exception as e:
        ending = ending_of(e, run.signals)
        events.emit(Stopping(ending.code, ending.message))
        raise
    finally:
        _let_go_of(run.signals, own_handler)
        import gc

        gc.enable()  # train.manual_gc disables it for the loop
        if profiler is not None:
            profiler.stop()
        try:
            run.close()  # pending async saves are finalized before exit
        except Exception as e:
            if not failed:  # the run's own ending: a save it still owed failed (raised after Ended)
                ending = ending_of(e, run.signals)
                raise
            # the run failed first (a peer died mid-save, say): that stays its ending, told to every listener
            log.warning("after the run ended (%s), closing it failed too: %s", ending.message or ending.code,
                        " ".join(str(e).split())[:500])
        finally:
            events.emit(Ended(ending.code, ending.message, run.state.train_state.step))
    return ending.code


def _let_go_of(handler: SignalHandler | None, own: bool) -> None:
    """After the loop: our own handler is released; the caller's is kept, but a signal changes nothing now."""
    if handler is not None and own:
        handler.release()
    elif handler is not None:
        handler.settle()


def _train_then_evaluate(forward_step_func, run: Run, profiler, non_loss) -> Ending:
    """train() (unless validation.skip_train), then, when training completed, the reference's evaluation
    after training on the validation and test splits. Returns how the run ends."""
    from kubetron.training.eval import final_evaluation
    from kubetron.training.train import train

    state, model, train_it, valid_it, test_it = run.state, run.model, run.train_it, run.valid_it, run.test_it
    if state.cfg.validation.skip_train:
        log.info("skipping training (validation.skip_train): evaluating the model of iteration %d",
                 state.train_state.step)
        if valid_it is not None:
            valid_it.load_state_dict({"consumed_samples": 0})  # as the reference: from the split's start
        code = exitcodes.COMPLETED
    else:
        code = train(forward_step_func, model, run.optimizer, run.scheduler, train_it, valid_it, state, run.ckpt,
                     events=run.events, straggler=run.straggler, profiler=profiler, **non_loss)
    ending = Ending(code, _message(code, run), False)
    run.events.emit(Stopping(ending.code, ending.message))
    if code == exitcodes.COMPLETED:
        final_evaluation(state, forward_step_func, model, valid_it, test_it, events=run.events,
                         time_up=run.ckpt.time_limit_reached, **non_loss)
    return ending


def _message(code: int, run: Run) -> str:
    """The one line a run that returned `code` ends with (the termination message's)."""
    if code == exitcodes.COMPLETED:
        return "evaluation completed (validation.skip_train)" if run.state.cfg.validation.skip_train \
            else "training completed"
    if code == exitcodes.STRAGGLER:
        return (run.straggler.message if run.straggler is not None else None) or "straggler detected; checkpoint saved"
    return {exitcodes.SAVED_ON_SIGNAL: "stopped by signal; checkpoint saved",
            exitcodes.EXIT_CONDITION: "exit condition reached; checkpoint saved"}.get(code, "")


def make_profiler(cfg, rank: int, first_iteration: int):
    """torch.profiler over iterations [profile_step_start, profile_step_end) on profile_ranks; the
    trace (TensorBoard's profiler plugin format) goes to profiling.output_dir."""
    p = cfg.profiling
    if not p.use_pytorch_profiler or rank not in p.profile_ranks or p.profile_step_end <= first_iteration:
        return None
    out = p.output_dir
    if out is None:
        base = cfg.logger.tensorboard_dir or (cfg.checkpoint.save if not str(cfg.checkpoint.save).startswith("s3://")
                                              else None) or "."
        out = os.path.join(base, "profile")
    start = max(p.profile_step_start, first_iteration + 1)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    log.info("profiling iterations %d..%d on rank %d into %s", start, p.profile_step_end - 1, rank, out)
    return torch.profiler.profile(
        activities=activities,
        # profiler.step() runs after each iteration: wait until just before `start`, record to the end.
        schedule=torch.profiler.schedule(wait=start - first_iteration - 1, warmup=0,
                                         active=p.profile_step_end - start, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(out, worker_name=f"rank{rank}"),
        record_shapes=p.record_shapes,
    )


class Ending(NamedTuple):
    code: int  # kubetron/contract/exitcodes.py
    message: str  # the termination message's, after "kubetron: <reason>: " in the pod's log
    unexpected: bool  # a plain trainer error: its traceback is the report


def ending_of(e: Exception, handler: SignalHandler | None = None) -> Ending:
    """How a run that raised `e` ended: the one map from exception to exit code that the exit status,
    the termination message and the progress log's `Exiting job ... Reason:` all use.

    A trainer error after a SIGTERM/SIGINT was recorded (`handler`) is the pod being stopped: 75.
    """
    from kubetron.training.train import DivergedError

    if isinstance(e, ConfigError):
        ending = Ending(exitcodes.CONFIG_ERROR, str(e), False)
    elif isinstance(e, ResumeMismatchError):
        ending = Ending(exitcodes.RESUME_MISMATCH, str(e), False)
    elif isinstance(e, DivergedError):
        ending = Ending(exitcodes.DIVERGED, str(e), False)
    elif isinstance(e, CheckpointError):
        ending = Ending(exitcodes.ERROR, f"checkpoint error: {e}", False)
    elif is_peer_failure(e):
        ending = Ending(exitcodes.PEER_FAILURE, f"a peer rank failed: {str(e).strip().splitlines()[0][:300]}", False)
    else:
        ending = Ending(exitcodes.ERROR, f"{type(e).__name__}: {e}", True)
    if handler is not None and handler.received is not None and ending.code == exitcodes.ERROR:
        return ending._replace(code=exitcodes.SAVED_ON_SIGNAL, message=f"{handler.signal_name} received, then "
                                                                        f"{ending.message}")
    return ending


def pretrain(config, forward_step_func, *, process_non_loss_data_func=None, non_loss_data_func=None) -> int:
    """Train from scratch (or resume from checkpoint.load), then evaluate; returns an exit code.

    As Megatron's pretrain(): `non_loss_data_func(model)`, or else one forward-only pass with
    `collect_non_loss_data=True` (`loss_func(output, non_loss_data=True)` returns anything), feeds
    `process_non_loss_data_func(data, iteration, tensorboard_writer)` at every evaluation, on the rank
    that writes TensorBoard (not called without logger.tensorboard_dir). Refuses, in one ConfigError, a
    megatron-core or torch outside the versions kubetron's adaptations were checked against.
    """
    megatron_core.install()
    return _run(config, forward_step_func, "pretrain", process_non_loss_data_func=process_non_loss_data_func,
                non_loss_data_func=non_loss_data_func)


def finetune(config, forward_step_func, *, process_non_loss_data_func=None, non_loss_data_func=None) -> int:
    """Resume from checkpoint.load if it has a checkpoint; else start from pretrained weights at 0.
    The non-loss data functions and the version check: see pretrain()."""
    megatron_core.install()
    return _run(config, forward_step_func, "finetune", process_non_loss_data_func=process_non_loss_data_func,
                non_loss_data_func=non_loss_data_func)


def exit_signals(cfg) -> tuple:
    """train.exit_signal (and SIGINT): what the signal handler saves and exits on."""
    import signal

    return (getattr(signal, cfg.train.exit_signal), signal.SIGINT)


def apply_logging_level(cfg, rank: int):
    """logger.logging_level on rank 0; other ranks log warnings and errors only."""
    level = logging.getLevelName(str(cfg.logger.logging_level).upper())
    logging.getLogger("kubetron").setLevel(level if rank == 0 else max(level, logging.WARNING))


def _setup_logging():
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[kubetron %(asctime)s] %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    for noisy in ("megatron", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_from_cli(cfg, mode: str = "pretrain", keep_signal_handler: bool = False, *,
                 signals: SignalHandler | None = None, faults: SaveFaults | None = None,
                 listeners: Sequence[Listener] = (), forward_step_func=None) -> int:
    """`kubetron train|finetune`: run, then report the ending: its one line (unless it completed), its
    termination message (a listener, `TerminationReport`), the exit code returned.

    The signal handler (train.exit_signal_handler) is installed before the slow setup and stays
    through teardown: a SIGTERM after the loop ended leaves the exit code as decided (0 for a
    completed run). `keep_signal_handler`: this process is the command (it exits with the code), so
    the signals are ignored from the return until the process exits; otherwise the handler is released.
    `signals`, `faults`, `listeners`: the caller's handler (not installed: tests deliver the signal), save
    faults and listeners, as `_run` takes them; `forward_step_func`: the GPT forward step unless given.
    """
    import warnings

    report = TerminationReport(cfg.train.termination_log,
                               None if cfg.validation.skip_train else getattr(cfg.train, "train_iters", None))
    if cfg.tokenizer.file_based and cfg.checkpoint.load:  # a resume trains with the checkpoint's tokenizer
        from kubetron.checkpoint.manager import adopt_checkpoint_tokenizer

        try:
            adopt_checkpoint_tokenizer(cfg)
        except CheckpointError as e:  # a checkpoint refused here ends as one refused by the run: one line
            return _report_end(report, Ended(*ending_of(e)[:2], None))
    # Validate the whole config before the slow imports: a bad value fails in well under a second. Once: the
    # run does not finalize it again.
    cfg.finalize(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    warnings.filterwarnings("ignore", module="megatron")
    _setup_logging()
    apply_logging_level(cfg, int(os.environ.get("RANK", "0")))

    # Install the signal handler before the slow setup: a SIGTERM during imports or model building
    # still ends with the "saved/preempted" exit code (the newest checkpoint is whatever was loaded).
    handler = signals
    if handler is None and cfg.train.exit_signal_handler:
        handler = SignalHandler(exit_signals(cfg))
    try:
        return _run_and_report(cfg, mode, forward_step_func, handler, faults, [report, *listeners], report)
    finally:
        if handler is not None and keep_signal_handler:
            handler.ignore_until_exit()
        elif handler is not None and signals is None:
            handler.release()


def _run_and_report(cfg, mode: str, forward_step_func, handler: SignalHandler | None, faults: SaveFaults | None,
                    listeners: list[Listener], report: TerminationReport) -> int:
    from kubetron.training.gpt_step import forward_step

    try:
        _run(cfg, forward_step_func or forward_step, mode, listeners=listeners, signals=handler, faults=faults,
             finalized=True)
    except ConfigError:
        raise  # the CLI prints one line and exits 2
    except Exception as e:
        ending = ending_of(e, handler)
        if ending.unexpected:
            traceback.print_exc()
        if report.ended is None:  # it failed before the run's events existed
            report(Ended(ending.code, ending.message, None))
    assert report.ended is not None  # every ending of _run reaches its listeners
    return _report_end(report, report.ended)


def _report_end(report: TerminationReport, ended: Ended) -> int:
    """The run's one line (unless it completed) and its termination message; returns the exit code."""
    if ended.code != exitcodes.COMPLETED:
        print(f"kubetron: {exitcodes.NAMES[ended.code]}: {ended.message}", file=sys.stderr, flush=True)
    if report.ended is None:
        report(ended)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    return ended.code
