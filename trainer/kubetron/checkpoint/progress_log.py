"""The progress log `progress.txt` beside the checkpoints, as this run writes it (rank 0; the line format is
kubetron.contract.progress): one of the run's listeners (kubetron.events), built by the composition root."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kubetron.contract import exitcodes
from kubetron.contract import progress as progress_log
from kubetron.contract.hang import HangReport
from kubetron.contract.progress import PROGRESS_FILE
from kubetron.events import CheckpointDurable, Ended, Event, Started


@dataclass(frozen=True)
class PodFacts:
    """What the pod's environment says about this process (kubetron.supervisor.progress_io reads it)."""

    job_id: str  # the job and attempt, for every line
    in_place_restarts: int = 0  # the restarts of the gang inside its pods so far
    hang: HangReport | None = None  # the newest hung gang the pod's agent restarted


class ProgressLog:
    """The progress log `progress.txt` beside the checkpoints (rank 0 writes; Megatron's line format): a line when
    the run starts (after a hang and an in-place restart, a line for each first), when a checkpoint is durable, and
    when the run ends."""

    def __init__(self, cfg, store, world_size: int, pod: PodFacts):
        self.cfg, self.store, self.world_size, self.pod = cfg, store, world_size, pod
        self._start_wall = time.time()
        self._start_flops = 0.0
        self._iteration = 0
        self._job_start_time = None  # the job's first start at this GPU count, from the log (read at start)
        self._job_start_flops = 0.0  # the FLOPs done before it (saved by runs at other GPU counts)

    def __call__(self, event: Event) -> None:
        match event:
            case Started():
                self._started(event)
            case CheckpointDurable():
                self._append(progress_log.saved_checkpoint_line(**self.fields(event), async_save=event.async_save,
                                                                job_id=self.pod.job_id))
            case Ended(code=code, iteration=iteration):
                self._append(progress_log.exiting_job_line(
                    iteration=self._iteration if iteration is None else iteration, reason=exitcodes.NAMES[code],
                    train_iters=self.cfg.train.train_iters, num_gpus=self.world_size, job_id=self.pod.job_id))

    def _append(self, line: str) -> None:
        self.store.append_line(PROGRESS_FILE, line)

    def _started(self, event: Started) -> None:
        self._start_flops, self._iteration = event.floating_point_operations, event.iteration
        common = dict(train_iters=self.cfg.train.train_iters, num_gpus=self.world_size, job_id=self.pod.job_id)
        hang, restarts = self.pod.hang, self.pod.in_place_restarts
        if hang is not None and hang["restart"] == restarts > 0:  # this restart: the gang hung
            self._append(progress_log.hang_detected_line(hang, **common))
        if restarts:
            self._append(progress_log.restarted_in_place_line(iteration=event.iteration, restarts=restarts, **common))
        self._append(progress_log.starting_job_line(iteration=event.iteration, **common))
        self._job_start_time, self._job_start_flops = self._job_start()

    def fields(self, event: CheckpointDurable) -> dict:
        """Throughput and counters for a "Saved checkpoint" line, as of the checkpoint's snapshot."""
        ts, cfg = event.train_state, self.cfg
        elapsed = max(event.taken - self._start_wall, 1e-9)
        flops = ts["floating_point_operations_so_far"]
        ngpu = self.world_size
        job_tp = (flops - self._start_flops) / elapsed / ngpu / 1e12
        start = self._job_start_time  # read at start: no store access in the loop
        cum_elapsed = max(event.taken - start.timestamp(), 1e-9) if start else elapsed
        return dict(iteration=event.checkpoint.iteration, job_throughput_tflops=job_tp,
                    cumulative_throughput_tflops=(flops - self._job_start_flops) / cum_elapsed / ngpu / 1e12,
                    flops_so_far=flops,
                    tokens_so_far=ts["consumed_train_samples"] * cfg.model.seq_length,
                    train_iters=cfg.train.train_iters, num_gpus=ngpu)

    def _job_start(self):
        try:
            text = self.store.read_bytes(PROGRESS_FILE).decode() if self.store.exists(PROGRESS_FILE) else ""
        except Exception:
            return None, 0.0
        return progress_log.get_start_time_from_progress_log(text, self.world_size)
