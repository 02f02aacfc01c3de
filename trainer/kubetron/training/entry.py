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
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from kubetron.contract import exitcodes
from kubetron.contract.errors import CheckpointError, ConfigError, ResumeMismatchError
from kubetron.contract.hang import TEARDOWN
from kubetron.supervisor import heartbeat
from kubetron.supervisor.startup import CLOCK
from kubetron.supervisor.termination_log import write_termination_message
from kubetron.training.state import GlobalState, SignalHandler, Timers

if TYPE_CHECKING:
    from kubetron.training.run import Run

log = logging.getLogger("kubetron")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_distributed(cfg) -> tuple[int, int, torch.device]:
    """torchrun's env (or MASTER_ADDR/RANK/WORLD_SIZE from the operator); else a world of one."""
    use_gpu = cfg.dist.use_gpu if cfg.dist.use_gpu is not None else torch.cuda.is_available()
    backend = cfg.dist.distributed_backend or ("nccl" if use_gpu else "gloo")
    timeout = timedelta(minutes=cfg.dist.distributed_timeout_minutes)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_gpu:
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


def _start(cfg, holder: dict | None, signal_handler: SignalHandler | None) -> GlobalState:
    """This process's part of the job: the process groups, the model-parallel groups, the seeds, and the
    state the loop and the forward step share (in `holder["state"]` at once: the caller reports progress
    even if the setup fails later)."""
    from megatron.core import parallel_state

    from kubetron.checkpoint.manager import adopt_checkpoint_tokenizer

    rank, world, device = initialize_distributed(cfg)
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
    state = GlobalState(cfg=cfg, rank=rank, world_size=world, device=device,
                        timers=Timers(cfg.logger.timing_log_level))
    if holder is not None:
        holder["state"] = state
    if cfg.train.exit_signal_handler:
        state.signal_handler = signal_handler or SignalHandler(exit_signals(cfg))
    return state


def _run(config, forward_step_func, mode: str, holder: dict | None = None,
         signal_handler: SignalHandler | None = None, **non_loss):
    from kubetron.training.run import build_run

    CLOCK.mark("imports")
    cfg = config
    state = _start(cfg, holder, signal_handler)
    own_handler = signal_handler is None  # the caller's handler is the caller's to release
    run = build_run(state, from_pretrained=mode == "finetune" or bool(cfg.checkpoint.pretrained_checkpoint))
    progress = None if cfg.validation.skip_train else run.ckpt.progress  # evaluation only: the log is left alone
    if progress is not None:
        progress.start()
    code = exitcodes.ERROR
    profiler = make_profiler(cfg, state.rank, state.train_state.step)
    try:
        if profiler is not None:
            profiler.start()
        code = _train_then_evaluate(forward_step_func, run, profiler, non_loss)
    except Exception as e:  # the progress log says how the job ended (as the exit code will)
        if progress is not None:
            progress.exit(exitcodes.NAMES[ending_of(e, state.signal_handler).code])
        raise
    finally:
        _let_go_of(state.signal_handler, own_handler)
        import gc

        gc.enable()  # train.manual_gc disables it for the loop
        if profiler is not None:
            profiler.stop()
        run.close()  # pending async saves are finalized before exit
    state.exit_code = code
    if progress is not None:
        progress.exit(exitcodes.NAMES[code])
    return code, state


def _let_go_of(handler: SignalHandler | None, own: bool) -> None:
    """After the loop: our own handler is released; the caller's is kept, but a signal changes nothing now."""
    if handler is not None and own:
        handler.release()
    elif handler is not None:
        handler.settle()


def _train_then_evaluate(forward_step_func, run: Run, profiler, non_loss) -> int:
    """train() (unless validation.skip_train), then, when training completed, the reference's evaluation
    after training on the validation and test splits. Returns the exit code."""
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
                     profiler=profiler, **non_loss)
    heartbeat.current().enter(TEARDOWN)  # judged again only in a final evaluation
    if code == exitcodes.COMPLETED:
        final_evaluation(state, forward_step_func, model, valid_it, test_it, **non_loss)
    return code


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
    that writes TensorBoard (not called without logger.tensorboard_dir).
    """
    return _run(config, forward_step_func, "pretrain", process_non_loss_data_func=process_non_loss_data_func,
                non_loss_data_func=non_loss_data_func)[0]


def finetune(config, forward_step_func, *, process_non_loss_data_func=None, non_loss_data_func=None) -> int:
    """Resume from checkpoint.load if it has a checkpoint; else start from pretrained weights at 0.
    The non-loss data functions: see pretrain()."""
    return _run(config, forward_step_func, "finetune", process_non_loss_data_func=process_non_loss_data_func,
                non_loss_data_func=non_loss_data_func)[0]


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


def run_from_cli(cfg, mode: str = "pretrain", keep_signal_handler: bool = False) -> int:
    """`kubetron train|finetune`: run, then map the ending to an exit code + termination message.

    The signal handler (train.exit_signal_handler) is installed before the slow setup and stays
    through teardown: a SIGTERM after the loop ended leaves the exit code as decided (0 for a
    completed run). `keep_signal_handler`: this process is the command (it exits with the code), so
    the signals are ignored from the return until the process exits; otherwise the handler is released.
    """
    import warnings

    if cfg.tokenizer.file_based and cfg.checkpoint.load:  # a resume trains with the checkpoint's tokenizer
        from kubetron.checkpoint.manager import adopt_checkpoint_tokenizer

        try:
            adopt_checkpoint_tokenizer(cfg)
        except CheckpointError as e:  # a checkpoint refused here ends as one refused by the run: one line
            return _report_end(cfg, *ending_of(e)[:2], None)
    # Validate the whole config before the slow imports: a bad value fails in well under a second.
    cfg.finalize(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    warnings.filterwarnings("ignore", module="megatron")
    _setup_logging()
    apply_logging_level(cfg, int(os.environ.get("RANK", "0")))

    # Install the signal handler before the slow setup: a SIGTERM during imports or model building
    # still ends with the "saved/preempted" exit code (the newest checkpoint is whatever was loaded).
    handler = None
    if cfg.train.exit_signal_handler:
        handler = SignalHandler(exit_signals(cfg))
    heartbeat.current()  # under the launcher: the hang watchdog's record and stack dumps, from here on
    try:
        return _run_and_report(cfg, mode, handler)
    finally:
        if handler is not None and keep_signal_handler:
            handler.ignore_until_exit()
        elif handler is not None:
            handler.release()


def _run_and_report(cfg, mode: str, handler: SignalHandler | None) -> int:
    from kubetron.training.gpt_step import forward_step

    holder: dict[str, GlobalState] = {}
    try:
        code, state = _run(cfg, forward_step, mode, holder, handler)
        msg = {exitcodes.COMPLETED: "evaluation completed (validation.skip_train)" if cfg.validation.skip_train
               else "training completed",
               exitcodes.SAVED_ON_SIGNAL: "stopped by signal; checkpoint saved",
               exitcodes.EXIT_CONDITION: "exit condition reached; checkpoint saved",
               exitcodes.STRAGGLER: (state.straggler.message if state.straggler is not None else None)
               or "straggler detected; checkpoint saved"}.get(code, "")
    except ConfigError:
        raise  # the CLI prints one line and exits 2
    except Exception as e:
        code, msg, unexpected = ending_of(e, handler)
        if unexpected:
            traceback.print_exc()
    return _report_end(cfg, code, msg, holder.get("state"))


def _report_end(cfg, code: int, msg: str, state) -> int:
    """The run's one line (unless it completed), its termination message; returns the exit code."""
    if code not in (exitcodes.COMPLETED,):
        print(f"kubetron: {exitcodes.NAMES[code]}: {msg}", file=sys.stderr, flush=True)
    ts = state.train_state if state is not None else None
    ckpt = state.ckpt if state is not None else None
    write_termination_message({
        "exitCode": code, "reason": exitcodes.NAMES[code],
        "iteration": ts.step if ts else None,
        "trainIters": None if cfg.validation.skip_train else getattr(cfg.train, "train_iters", None),
        "lastCheckpoint": ckpt.last_durable if ckpt else None,
        "message": msg,
    }, cfg.train.termination_log)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    return code
