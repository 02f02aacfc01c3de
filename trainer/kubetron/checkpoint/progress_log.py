"""The progress log `progress.txt` beside the checkpoints, as this run writes it (rank 0; the line format is
kubetron.contract.progress)."""

from __future__ import annotations

import time

import torch.distributed as dist

from kubetron.contract import progress as progress_log
from kubetron.contract.progress import PROGRESS_FILE
from kubetron.supervisor.progress_io import hangs, in_place_restarts, job_id


class ProgressLog:
    """The progress log `progress.txt` beside the checkpoints (rank 0 writes; Megatron's line format)."""

    def __init__(self, cfg, store, train_state, world_size: int):
        self.cfg, self.store, self.train_state, self.world_size = cfg, store, train_state, world_size
        self._start_wall = time.time()
        self._start_flops: float | None = None
        self._job_start_time = None  # the job's first start at this GPU count, from the log (read at start())
        self._job_start_flops = 0.0  # the FLOPs done before it (saved by runs at other GPU counts)

    @property
    def enabled(self) -> bool:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return bool(self.cfg.logger.log_progress and self.store is not None and rank == 0)

    def start(self):
        if self.enabled:
            self._start_flops = self.train_state.floating_point_operations_so_far
            _, hang = hangs()
            if hang is not None and hang["restart"] == in_place_restarts() > 0:  # this restart: the gang hung
                self.store.append_line(PROGRESS_FILE, progress_log.hang_detected_line(
                    hang, self.cfg.train.train_iters, num_gpus=self.world_size, job_id=job_id()))
            if in_place_restarts():
                self.store.append_line(PROGRESS_FILE, progress_log.restarted_in_place_line(
                    iteration=self.train_state.step, restarts=in_place_restarts(),
                    train_iters=self.cfg.train.train_iters, num_gpus=self.world_size, job_id=job_id()))
            self.store.append_line(PROGRESS_FILE, progress_log.starting_job_line(
                iteration=self.train_state.step, train_iters=self.cfg.train.train_iters,
                num_gpus=self.world_size, job_id=job_id()))
            self._job_start_time, self._job_start_flops = self._job_start()

    def exit(self, reason: str):
        if self.enabled:
            self.store.append_line(PROGRESS_FILE, progress_log.exiting_job_line(
                iteration=self.train_state.step, reason=reason, train_iters=self.cfg.train.train_iters,
                num_gpus=self.world_size, job_id=job_id()))

    def saved(self, fields: dict, *, async_save: bool):
        if self.enabled:
            line = progress_log.saved_checkpoint_line(**fields, async_save=async_save, job_id=job_id())
            self.store.append_line(PROGRESS_FILE, line)

    def fields(self, iteration: int) -> dict:
        """Throughput and counters for a "Saved checkpoint" line, taken when the snapshot is."""
        ts, cfg = self.train_state, self.cfg
        elapsed = max(time.time() - self._start_wall, 1e-9)
        flops = ts.floating_point_operations_so_far
        ngpu = self.world_size
        job_tp = (flops - (self._start_flops or 0.0)) / elapsed / ngpu / 1e12
        start = self._job_start_time  # read at start(): no store access in the loop
        cum_elapsed = max(time.time() - start.timestamp(), 1e-9) if start else elapsed
        return dict(iteration=iteration, job_throughput_tflops=job_tp,
                    cumulative_throughput_tflops=(flops - self._job_start_flops) / cum_elapsed / ngpu / 1e12,
                    flops_so_far=flops,
                    tokens_so_far=ts.consumed_train_samples * cfg.model.seq_length,
                    train_iters=cfg.train.train_iters, num_gpus=ngpu)

    def _job_start(self):
        try:
            text = self.store.read_bytes(PROGRESS_FILE).decode() if self.store.exists(PROGRESS_FILE) else ""
        except Exception:
            return None, 0.0
        return progress_log.get_start_time_from_progress_log(text, self.world_size)
