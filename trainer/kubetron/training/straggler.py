"""Straggler detection (config section `straggler`): compare the ranks' compute times.

Every rank times its forward/backward compute of each step (`compute_timer`, wrapped around the
micro-batch schedule in train_step; CUDA events on GPU, so there is no extra device sync; the
time is read at report time). Every `report_interval` iterations the per-rank mean is all-gathered
(one small collective on all ranks, at the same iteration everywhere), and rank 0 logs the
`straggler_minmax_count` slowest and fastest ranks with their relative performance
`fastest_time / own_time` (1.0 = as fast as the fastest rank). A rank whose relative performance is
below `relative_threshold` is a straggler; with `stop_if_detected` every rank sees the same gathered
numbers, so all of them stop at that iteration: the loop saves a checkpoint and exits 6.

What is measured: the time spent in the micro-batch schedule. Across data-parallel ranks that is
pure compute (gradient all-reduce comes after it), so a slow replica stands out. Inside a
model-parallel group the schedule includes the TP collectives and PP send/recv, so a slow rank also
makes its TP/PP peers wait and their measured time grows too: the slowest group is found, the
slowest rank within it may not be.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.distributed as dist

from kubetron.contract import exitcodes

log = logging.getLogger("kubetron")


class StragglerDetector:
    def __init__(self, cfg, device: torch.device):
        s = cfg.straggler
        self.interval = int(s.report_interval)
        self.minmax = int(s.straggler_minmax_count)
        self.threshold = float(s.relative_threshold)
        self.stop = bool(s.stop_if_detected)
        self.cuda = device.type == "cuda"
        self._host_times: list[float] = []
        self._events: list[tuple] = []
        self.message: str | None = None
        self.last_report: list[tuple[int, float, float]] | None = None  # (rank, mean ms, relative)

    @classmethod
    def from_config(cls, cfg, device) -> StragglerDetector | None:
        s = getattr(cfg, "straggler", None)
        if s is None or not (s.log_straggler or s.stop_if_detected):
            return None
        return cls(cfg, device)

    @contextlib.contextmanager
    def time_compute(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._host_times.append(time.perf_counter() - t0)

    def _mean_seconds(self) -> float:
        times = list(self._host_times)
        if self._events:
            self._events[-1][1].synchronize()
            times += [s.elapsed_time(e) / 1000.0 for s, e in self._events]
        self._host_times, self._events = [], []
        return sum(times) / len(times) if times else 0.0

    def after_step(self, iteration: int) -> int | None:
        """Report every `interval` iterations (collective); returns exitcodes.STRAGGLER to stop."""
        if iteration % self.interval:
            return None
        mean = self._mean_seconds()
        world = dist.get_world_size() if dist.is_initialized() else 1
        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        local = torch.tensor([mean], dtype=torch.float64, device=device)
        if world > 1:
            parts = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(parts, local)
            times = [float(p.item()) for p in parts]
        else:
            times = [mean]
        fastest = min((t for t in times if t > 0), default=0.0)
        rel = [(fastest / t) if t > 0 else 1.0 for t in times]
        ranked = sorted(range(world), key=lambda r: rel[r])
        self.last_report = [(r, times[r] * 1000.0, rel[r]) for r in ranked]
        slow = [r for r in ranked if rel[r] < self.threshold]
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            fmt = ", ".join
            log.info("straggler report at iteration %d: slowest ranks %s | fastest ranks %s", iteration,
                     fmt(f"rank {r} ({times[r] * 1000:.1f} ms, relative {rel[r]:.2f})" for r in ranked[:self.minmax]),
                     fmt(f"rank {r} ({times[r] * 1000:.1f} ms, relative {rel[r]:.2f})"
                         for r in reversed(ranked[-self.minmax:])))
            if slow:
                log.warning("straggler detected at iteration %d: %s below relative_threshold %.2f", iteration,
                            fmt(f"rank {r} ({rel[r]:.2f})" for r in slow), self.threshold)
        if slow and self.stop:
            self.message = (f"straggler detected at iteration {iteration}: "
                            + ", ".join(f"rank {r} at {rel[r]:.2f} of the fastest rank's speed" for r in slow)
                            + f" (relative_threshold {self.threshold}); checkpoint saved")
            return exitcodes.STRAGGLER
        return None


def compute_timer(detector: StragglerDetector | None):
    """Context manager timing the compute of one step when straggler detection is on (else a no-op)."""
    return detector.time_compute() if detector is not None else contextlib.nullcontext()
