"""Console lines in Megatron's format, TensorBoard scalars with the reference's keys: one of the run's
listeners (kubetron.events).

Per-iteration values stay on the device (no `.item()`) until log time: every `log_interval`
iterations the buffered tensors are moved to the host in one go, written to TensorBoard for each
iteration, and averaged into one console line; the interval's figures go on as a `Logged` event (rank 0's
status endpoint serves them).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import datetime

import torch

from kubetron.events import Evaluated, Event, Logged, StepDone, Stopping
from kubetron.training.status_server import Pace
from kubetron.training.trackers import build_trackers
from kubetron.training.utils import report_memory

log = logging.getLogger("kubetron")


class MetricsLogger:
    """A run's listener: `StepDone` buffered, logged every `log_interval` iterations and when the loop stops;
    `Evaluated` logged at once. `emit` receives the `Logged` figures."""

    def __init__(self, cfg, state, *, writes: bool, world_size: int, rank: int, start_time: float,
                 emit: Callable[[Logged], object] = lambda event: None):
        self.cfg = cfg
        self.state = state  # the forward steps' façade: train_state, timers, the loggers
        self.writes = writes  # the last rank holds the loss: it prints and writes TensorBoard
        self.world_size, self.rank, self.start_time = world_size, rank, start_time
        self.emit = emit
        self.writer = state.tensorboard_logger if writes else None  # the state's: forward steps share it
        self.trackers = build_trackers(cfg, state) if writes else []  # wandb / MLflow: TensorBoard's scalars
        self._memory_reported = False  # the console's memory line, once (after the optimizer state exists)
        self._pending: list[tuple[int, dict, float, torch.Tensor | None, torch.Tensor | None]] = []
        self._loss_scales: list[float] = []  # one per pending iteration (host floats)
        self._skipped = 0
        self._nan = 0
        self._last_log_time = time.perf_counter()
        self._last_log_iter: int | None = None
        self._iteration = state.train_state.step
        self.pace = Pace(cfg.logger.throughput_window_size, cfg.train.global_batch_size * cfg.model.seq_length,
                         cfg.train.train_iters, time.perf_counter)

    def __call__(self, event: Event) -> None:
        match event:
            case StepDone():
                self.record_step(event.iteration, event.losses, event.learning_rate, event.grad_norm,
                                 int(event.skipped), event.params_norm, event.loss_scale)
            case Stopping():
                self.flush(self._iteration)
            case Evaluated():
                self.log_validation(event.iteration, event.losses, event.prefix, label=event.label,
                                    tensorboard=event.tensorboard)

    # -- per iteration (cheap, no sync) ----------------------------------------------------------
    def record_step(self, iteration: int, loss_dict: dict, lr: float, grad_norm, skipped: int,
                    params_norm=None, loss_scale: float = 1.0):
        if self._last_log_iter is None:
            self._last_log_iter = iteration - 1
        self._iteration = iteration
        self.pace.step(iteration, time.perf_counter())
        self._skipped += skipped
        if skipped and any(not bool(torch.isfinite(v.detach()).all()) for v in loss_dict.values()):
            self._nan += 1  # as Megatron: a skipped iteration whose loss was NaN/Inf (rare: syncs only then)
        self._pending.append((iteration, loss_dict, lr, grad_norm, params_norm))
        self._loss_scales.append(loss_scale)  # the scale this iteration's backward used
        if iteration % self.cfg.logger.log_interval == 0:
            self.flush(iteration)

    # -- at log time ------------------------------------------------------------------------------
    def flush(self, iteration: int):
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        scales, self._loss_scales = self._loss_scales, []
        host = _to_host([(d, g, p) for _, d, _, g, p in pending])  # one device→host copy
        now = time.perf_counter()
        n_iters = max(iteration - (self._last_log_iter or 0), 1)
        elapsed_ms = (now - self._last_log_time) * 1000.0 / n_iters
        self._last_log_time, self._last_log_iter = now, iteration
        cfg, ts = self.cfg, self.state.train_state
        gbs = cfg.train.global_batch_size
        seq = cfg.model.seq_length
        tokens_per_sec = self.pace.tokens_per_second()
        device_tokens_per_sec = tokens_per_sec / self.world_size
        remaining = self.pace.remaining_seconds(iteration)
        self.emit(self._logged(iteration, pending, host, elapsed_ms, gbs))
        times = self.state.timers.pop_all()  # every rank resets its timers
        if not self.writes:
            return
        for (it, _, lr, _, _), (losses, gnorm, pnorm), scale in zip(pending, host, scales, strict=True):
            scalars = {**losses, "learning-rate": lr, "loss-scale": scale, "batch-size": gbs}
            if gnorm is not None:
                scalars["grad-norm"] = gnorm
                if cfg.logger.log_l2_norm_grad_to_tensorboard:
                    scalars["l2_norm/grad/global"] = gnorm
            if pnorm is not None:
                scalars["params-norm"] = pnorm
            self._write(scalars, it)
        scalars = {"time/remaining_estimate": remaining, "time/tokens": ts.consumed_train_samples * seq,
                   "time/samples": ts.consumed_train_samples, "time/batches": iteration,
                   "time/total": time.time() - self.start_time}
        if cfg.logger.log_throughput:
            scalars["throughput/tokens_per_sec"] = tokens_per_sec
            scalars["throughput/device/tokens_per_sec"] = device_tokens_per_sec
        memory = report_memory()
        if cfg.logger.log_memory_to_tensorboard:
            scalars.update(memory)
        if cfg.logger.log_timers_to_tensorboard:  # Megatron's names: seconds per iteration
            scalars.update({("iteration-time" if k == "interval-time" else f"{k}-time"): v / n_iters
                            for k, v in times.items()})
        self._write(scalars, iteration)
        if self.writer is not None:
            self.writer.flush()
        self._console(iteration, pending, host, elapsed_ms, gbs, scales[-1])
        # interval-time is the console line's "elapsed time per iteration": the timers line has the others (level >= 1)
        timed = {k: v for k, v in times.items() if k != "interval-time"}
        if timed:
            print(" time (ms, per iteration) | " + " | ".join(f"{k}: {1000 * v / n_iters:.2f}"
                                                              for k, v in timed.items()), flush=True)
        if memory and not self._memory_reported:
            self._memory_reported = True
            print(f"[Rank {self.rank}] (after {iteration} iterations) memory (GB) | "
                  + " | ".join(f"{k}: {v}" for k, v in memory.items()), flush=True)

    def _write(self, scalars: dict[str, float], step: int, tensorboard: bool = True):
        """TensorBoard and the experiment trackers: the same names, values and step."""
        if tensorboard and self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
        for t in self.trackers:
            t.log(scalars, step)

    def _console(self, iteration, pending, host, elapsed_ms, gbs, loss_scale: float):
        from kubetron.training.utils import num_floating_point_operations

        cfg = self.cfg
        tflops = num_floating_point_operations(cfg, gbs) / (elapsed_ms / 1000.0) / 1e12 / self.world_size
        lr = pending[-1][2]
        parts = [
            f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{cfg.train.train_iters:8d}",
            f"consumed samples: {self.state.train_state.consumed_train_samples:12d}",
            f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {gbs:5d}",
        ]
        if cfg.logger.log_throughput:
            parts.insert(3, f"throughput per GPU (TFLOP/s/GPU): {tflops:.3f}")
        sums: dict[str, list[float]] = {}
        for losses, _, _ in host:
            for k, v in losses.items():
                if not k.startswith("moe/"):  # per-layer MoE values: TensorBoard only (as Megatron)
                    sums.setdefault(k, []).append(v)
        for k, vals in sums.items():
            finite = [v for v in vals if math.isfinite(v)]
            parts.append(f"{k}: {sum(finite) / max(len(finite), 1):.6E}")
        parts.append(f"loss scale: {loss_scale:.1f}")
        gnorm = host[-1][1]
        if gnorm is not None:
            parts.append(f"grad norm: {gnorm:.3f}")
        pnorm = host[-1][2]
        if pnorm is not None:
            parts.append(f"params norm: {pnorm:.3f}")
        parts.append(f"number of skipped iterations: {self._skipped:3d}")
        parts.append(f"number of nan iterations: {self._nan:3d}")
        self._skipped = self._nan = 0
        print(" | ".join(parts) + " |", flush=True)

    def log_validation(self, iteration: int, losses: dict[str, float], prefix: str | None = None,
                       label: str = "validation", tensorboard: bool = True):
        """The reference's ` validation loss at <prefix> | <key> value: ... | <key> PPL: ... |` line (prefix:
        `iteration N`, or `iteration N on validation set` / `on test set` after training), and the
        `<key> <label>`, `<key> <label> ppl` scalars at `iteration` (TensorBoard only if `tensorboard`)."""
        if not self.writes:
            return
        line, scalars = f" validation loss at {prefix or f'iteration {iteration}'} | ", {}
        for k, v in losses.items():
            ppl = math.exp(min(20.0, v)) if math.isfinite(v) else float("nan")
            line += f"{k} value: {v:.6E} | {k} PPL: {ppl:.6E} | "
            scalars.update({f"{k} {label}": v, f"{k} {label} ppl": ppl})
        self._write(scalars, iteration, tensorboard=tensorboard)
        if self.writer is not None:
            self.writer.flush()
        print("-" * (len(line) + 1) + "\n" + line + "\n" + "-" * (len(line) + 1), flush=True)

    def _logged(self, iteration: int, pending, host, elapsed_ms: float, gbs: int) -> Logged:
        """loss (the first loss key, e.g. `lm loss`, averaged over the interval's finite values), the last
        learning rate and TFLOP/s per GPU: what the console line prints, for GET /status and /metrics."""
        from kubetron.training.utils import num_floating_point_operations

        values = [v for losses, _, _ in host for v in list(losses.values())[:1] if math.isfinite(v)]
        seconds = max(elapsed_ms, 1e-6) / 1000.0
        tflops = num_floating_point_operations(self.cfg, gbs) / seconds / 1e12 / self.world_size
        return Logged(iteration, sum(values) / len(values) if values else None, float(pending[-1][2]),
                      float(f"{tflops:.4g}"))  # 4 digits: a CPU run's 0.0004 is not 0

    def close(self):
        for t in self.trackers:
            t.close()
        self.trackers = []
        self.writer = None
        if self.writes:
            self.state.close_loggers()  # the TensorBoard writer and the wandb run


def _to_host(items):
    """Move all buffered per-iteration tensors to the host with one synchronization."""
    flat: list[torch.Tensor] = []
    for losses, gnorm, pnorm in items:
        flat.extend(v.detach().float().reshape(()) for v in losses.values())
        for t in (gnorm, pnorm):
            if t is not None:
                flat.append(t.detach().float().reshape(()))
    values = torch.stack(flat).cpu().tolist() if flat else []
    out, pos = [], 0
    for losses, gnorm, pnorm in items:
        lv = {}
        for k in losses:
            lv[k] = values[pos]
            pos += 1
        g = p = None
        if gnorm is not None:
            g = values[pos]
            pos += 1
        if pnorm is not None:
            p = values[pos]
            pos += 1
        out.append((lv, g, p))
    return out
