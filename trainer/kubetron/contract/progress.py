"""The progress log (`<store>/progress.txt`): one definition of its format, for both halves.

The trainer appends lines with `format_line` and the helpers for the standard events; the operator
(and `kubetron progress STORE`) reads them back with `parse_progress` / `summarize_events`. Reading a
store, and the job id and restart count a pod's environment holds, are the trainer's (kubetron.supervisor.progress_io).
The format is Megatron's tab-separated one (docs/CONTRACT.md):

    time \\t Job ID: <id> \\t # GPUs: <n> \\t <event> [\\t Key: value ...]

with `time` as `%Y-%m-%d %H:%M:%S` in UTC. Parsing is tolerant: blank or garbled lines, unknown
events and unknown keys are ignored, so a log torn by a crash mid-write still reads.

Standard library only, no I/O: the operator image imports it without the trainer's dependencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NotRequired, TypedDict

from kubetron.contract.hang import HangReport
from kubetron.contract.times import stamp

PROGRESS_FILE = "progress.txt"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
JOB_ID_ENV = "KUBETRON_JOB_ID"  # the pod's job id, <namespace>/<job>/<attempt>: every line's

STARTING_JOB = "Starting job"
SAVED_CHECKPOINT = "Saved checkpoint"
SAVED_ASYNC_CHECKPOINT = "Saved async checkpoint"
EXITING_JOB = "Exiting job"
RESTARTED_IN_PLACE = "Restarted in place"  # before the "Starting job" of a gang restarted inside its pods
HANG_DETECTED = "Hang detected"  # before the "Restarted in place" of a gang restarted after it hung
IN_PLACE_RESTARTS_KEY = "In-place restarts"  # its count within the attempt (docs/recovery.md)
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's, in every rank's environment: the count
CHECKPOINT_EVENTS = frozenset({SAVED_CHECKPOINT, SAVED_ASYNC_CHECKPOINT})

_JOB_ID_PREFIX = "Job ID:"
_GPUS_PREFIX = "# GPUs:"


# --------------------------------------------------------------------------------------------------
# Writing


def _clean(value: object) -> str:
    """A value as it may appear in a line: no tabs or line breaks (they would split the record)."""
    text = str(value)
    if "\t" in text or "\n" in text or "\r" in text:
        text = " ".join(text.replace("\t", " ").splitlines())
    return text


def format_time(now: datetime | None = None) -> str:
    """`%Y-%m-%d %H:%M:%S` in UTC (naive datetimes are taken to be UTC already)."""
    if now is None:
        now = datetime.now(UTC)
    elif now.tzinfo is not None:
        now = now.astimezone(UTC)
    return now.strftime(TIME_FORMAT)


def format_line(
    event: str,
    *,
    job_id: str,
    num_gpus: int,
    fields: dict[str, object] | None = None,
    now: datetime | None = None,
) -> str:
    """One progress-log line (no trailing newline): time, job id, GPU count, event, `Key: value`s in order."""
    parts = [format_time(now), f"Job ID: {_clean(job_id)}", f"# GPUs: {int(num_gpus)}", _clean(event)]
    for key, value in (fields or {}).items():
        parts.append(f"{_clean(key)}: {_clean(value)}")
    return "\t".join(parts)


def starting_job_line(
    iteration: int,
    train_iters: int,
    *,
    num_gpus: int,
    job_id: str,
    now: datetime | None = None,
) -> str:
    """`Starting job  Iteration: <it>  Train iters: <n>` (iteration = the one resumed from, 0 if fresh)."""
    return format_line(
        STARTING_JOB,
        job_id=job_id,
        num_gpus=num_gpus,
        fields={"Iteration": int(iteration), "Train iters": int(train_iters)},
        now=now,
    )


def restarted_in_place_line(
    iteration: int,
    restarts: int,
    train_iters: int,
    *,
    num_gpus: int,
    job_id: str,
    now: datetime | None = None,
) -> str:
    """`Restarted in place  Iteration: <resumed from>  In-place restarts: <n in this attempt>  Train iters: <n>`."""
    return format_line(
        RESTARTED_IN_PLACE,
        job_id=job_id,
        num_gpus=num_gpus,
        fields={"Iteration": int(iteration), IN_PLACE_RESTARTS_KEY: int(restarts), "Train iters": int(train_iters)},
        now=now,
    )


def hang_detected_line(hang: HangReport, train_iters: int, *, num_gpus: int, job_id: str,
                       now: datetime | None = None) -> str:
    """`Hang detected  Iteration: <it>  Rank: <r>  Pod rank: <n>  Phase: <p>  Idle seconds: <s>  State: <how>
    In-place restarts: <the restart it caused>  Stacks: <where>  Train iters: <n>` (kubetron.contract.hang)."""
    return format_line(
        HANG_DETECTED,
        job_id=job_id,
        num_gpus=num_gpus,
        fields={"Iteration": hang["iteration"], "Rank": hang["rank"], "Pod rank": hang["nodeRank"],
                "Phase": hang["phase"], "Idle seconds": f"{hang['idleSeconds']:.0f}", "State": hang["state"],
                IN_PLACE_RESTARTS_KEY: hang["restart"], "Stacks": hang["stacks"] or "-",
                "Train iters": int(train_iters)},
        now=now,
    )


def saved_checkpoint_line(
    iteration: int,
    job_throughput_tflops: float,
    cumulative_throughput_tflops: float,
    flops_so_far: float,
    tokens_so_far: int,
    train_iters: int,
    async_save: bool = False,
    *,
    num_gpus: int,
    job_id: str,
    now: datetime | None = None,
) -> str:
    """`Saved checkpoint` (or `Saved async checkpoint`) with throughputs, FLOPs and tokens so far.

    Append it only once the checkpoint is durable (its commit marker exists).
    """
    return format_line(
        SAVED_ASYNC_CHECKPOINT if async_save else SAVED_CHECKPOINT,
        job_id=job_id,
        num_gpus=num_gpus,
        fields={
            "Iteration": int(iteration),
            "Job throughput": f"{float(job_throughput_tflops):.1f} TFLOP/s/GPU",
            "Cumulative throughput": f"{float(cumulative_throughput_tflops):.1f} TFLOP/s/GPU",
            "Floating-point operations": f"{float(flops_so_far):.2e}",
            "Tokens (in billions)": f"{int(tokens_so_far) / 10**9:.2f}",
            "Tokens": int(tokens_so_far),
            "Train iters": int(train_iters),
        },
        now=now,
    )


def exiting_job_line(
    iteration: int,
    reason: str,
    train_iters: int,
    *,
    num_gpus: int,
    job_id: str,
    now: datetime | None = None,
) -> str:
    """`Exiting job  Iteration: <it>  Reason: <exitcodes.NAMES[code]>  Train iters: <n>`."""
    return format_line(
        EXITING_JOB,
        job_id=job_id,
        num_gpus=num_gpus,
        fields={"Iteration": int(iteration), "Reason": reason, "Train iters": int(train_iters)},
        now=now,
    )


# --------------------------------------------------------------------------------------------------
# Parsing


@dataclass(slots=True)
class ProgressEvent:
    """One parsed line. `fields` keeps every `Key: value` as strings, unknown keys included."""

    time: datetime  # timezone-aware, UTC
    job_id: str
    num_gpus: int
    event: str
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def iteration(self) -> int | None:
        return as_int(self.fields.get("Iteration"))

    @property
    def train_iters(self) -> int | None:
        return as_int(self.fields.get("Train iters"))

    @property
    def is_checkpoint(self) -> bool:
        return self.event in CHECKPOINT_EVENTS

    def to_json(self) -> dict[str, Any]:
        return {
            "time": stamp(self.time),
            "jobId": self.job_id,
            "gpus": self.num_gpus,
            "event": self.event,
            "fields": dict(self.fields),
        }


class CheckpointRef(TypedDict):
    """A durable checkpoint as the progress summary and the status endpoint name it."""

    iteration: int
    time: str | None  # contract.times.stamp()


class LastExit(TypedDict):
    iteration: int | None
    reason: str | None  # exitcodes.NAMES[code]
    time: str


class ProgressSummary(TypedDict):
    """What `summarize_events` returns (see there), `kubetron progress --json` prints and the operator reads."""

    lastCheckpoint: CheckpointRef | None
    trainIters: int | None
    iteration: int | None
    jobIterations: dict[str, int]
    tokens: int | None
    floatingPointOperations: float | None
    jobThroughput: float | None
    cumulativeThroughput: float | None
    jobs: int
    startTime: str | None
    completed: bool
    lastExit: LastExit | None
    inPlaceRestarts: dict[str, int]
    hangs: dict[str, int]  # job id -> its "Hang detected" lines
    events: NotRequired[list[dict[str, Any]]]  # left out by `--no-events` and the operator's S3 read
    store: NotRequired[str]  # `kubetron progress STORE`'s location


def as_int(text: str | None) -> int | None:
    """An integer field's value ("12", or a whole float such as "1.00e+03"); None for anything else."""
    if text is None:
        return None
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:  # "1.00e+03" or "12.0": accept a float that is a whole number
        value = float(text)
    except ValueError:
        return None
    if math.isfinite(value) and value == int(value):
        return int(value)
    return None


def _as_float(text: str | None) -> float | None:
    """The leading number of a value: "0.1 TFLOP/s/GPU" -> 0.1, "1.23e+12" -> 1.23e12."""
    if text is None:
        return None
    head = text.strip().split(" ", 1)[0]
    try:
        value = float(head)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _parse_time(text: str) -> datetime | None:
    """`%Y-%m-%d %H:%M:%S` as UTC, by hand (strptime is the parser's bottleneck)."""
    t = text.strip()
    if len(t) != 19 or t[4] != "-" or t[7] != "-" or t[10] != " " or t[13] != ":" or t[16] != ":":
        return None
    digits = t[0:4] + t[5:7] + t[8:10] + t[11:13] + t[14:16] + t[17:19]
    if not (digits.isascii() and digits.isdigit()):
        return None
    try:
        return datetime(
            int(t[0:4]), int(t[5:7]), int(t[8:10]), int(t[11:13]), int(t[14:16]), int(t[17:19]), tzinfo=UTC
        )
    except ValueError:
        return None


def parse_line(line: str) -> ProgressEvent | None:
    """One line -> a ProgressEvent, or None when it is blank or does not have the four leading columns."""
    line = line.rstrip("\r\n")
    if not line.strip():
        return None
    tokens = line.split("\t")
    if len(tokens) < 4:
        return None
    when = _parse_time(tokens[0])
    if when is None:
        return None
    job_token = tokens[1].strip()
    if not job_token.startswith(_JOB_ID_PREFIX):
        return None
    gpus_token = tokens[2].strip()
    if not gpus_token.startswith(_GPUS_PREFIX):
        return None
    try:
        num_gpus = int(gpus_token[len(_GPUS_PREFIX) :].strip())
    except ValueError:
        return None
    event = tokens[3].strip()
    if not event:
        return None
    fields: dict[str, str] = {}
    for token in tokens[4:]:
        key, sep, value = token.partition(":")
        key = key.strip()
        if not sep or not key:
            continue  # not a `Key: value` pair: ignore it, keep the rest of the line
        fields[key] = value.strip()
    return ProgressEvent(
        time=when,
        job_id=job_token[len(_JOB_ID_PREFIX) :].strip(),
        num_gpus=num_gpus,
        event=event,
        fields=fields,
    )


def parse_progress(text: str) -> list[ProgressEvent]:
    """Every well-formed line of a progress log, in file order."""
    events = []
    for line in text.splitlines():
        parsed = parse_line(line)
        if parsed is not None:
            events.append(parsed)
    return events


def _checkpoint_tokens(ev: ProgressEvent) -> int | None:
    exact = as_int(ev.fields.get("Tokens"))
    if exact is not None:
        return exact
    billions = _as_float(ev.fields.get("Tokens (in billions)"))  # Megatron's own lines have only this
    return None if billions is None else round(billions * 10**9)


def summarize_events(events: list[ProgressEvent]) -> ProgressSummary:
    """A JSON-ready summary of a parsed log (what the operator and `kubetron progress` report).

    Keys: lastCheckpoint ({iteration, time} of the last Saved [async] checkpoint, or None), trainIters
    (latest seen), iteration (latest mentioned by any event, in file order), jobIterations (job id ->
    the latest iteration its lines mention: the operator's job ids are <ns>/<job>/<attempt>), tokens,
    floatingPointOperations, jobThroughput, cumulativeThroughput (of the last checkpoint), jobs (number of
    Starting job lines), startTime (earliest Starting job), completed, lastExit ({iteration, reason,
    time} or None), inPlaceRestarts (job id -> its in-place restarts, from Restarted in place lines),
    hangs (job id -> its Hang detected lines) and events (every parsed line).

    `completed` is true when the last Exiting job after the last Starting job says `Completed`, or the
    last checkpoint's iteration reached the latest Train iters.
    """
    last_ckpt: ProgressEvent | None = None
    last_exit: ProgressEvent | None = None
    exit_since_start: ProgressEvent | None = None
    train_iters: int | None = None
    iteration: int | None = None
    jobs = 0
    start_time: datetime | None = None
    by_job: dict[str, int] = {}
    in_place: dict[str, int] = {}
    hangs: dict[str, int] = {}

    for ev in events:
        it = ev.iteration
        if it is not None:
            iteration = it
            by_job[ev.job_id] = it
        ti = ev.train_iters
        if ti is not None:
            train_iters = ti
        if ev.event == STARTING_JOB:
            jobs += 1
            if start_time is None or ev.time < start_time:
                start_time = ev.time
            exit_since_start = None
        elif ev.is_checkpoint:
            if it is not None:
                last_ckpt = ev
        elif ev.event == EXITING_JOB:
            last_exit = ev
            exit_since_start = ev
        elif ev.event == RESTARTED_IN_PLACE:
            count = as_int(ev.fields.get(IN_PLACE_RESTARTS_KEY)) or 0
            in_place[ev.job_id] = max(in_place.get(ev.job_id, 0), count)
        elif ev.event == HANG_DETECTED:
            hangs[ev.job_id] = hangs.get(ev.job_id, 0) + 1

    completed = False
    if exit_since_start is not None and exit_since_start.fields.get("Reason") == "Completed":
        completed = True
    if last_ckpt is not None and train_iters is not None and train_iters > 0:
        ckpt_it = last_ckpt.iteration
        if ckpt_it is not None and ckpt_it >= train_iters:
            completed = True

    ckpt_fields = last_ckpt.fields if last_ckpt is not None else {}
    ckpt_it = last_ckpt.iteration if last_ckpt is not None else None  # set only with an iteration
    return {
        "lastCheckpoint": (
            {"iteration": ckpt_it, "time": stamp(last_ckpt.time)} if last_ckpt and ckpt_it is not None else None
        ),
        "trainIters": train_iters,
        "iteration": iteration,
        "jobIterations": by_job,
        "tokens": _checkpoint_tokens(last_ckpt) if last_ckpt else None,
        "floatingPointOperations": _as_float(ckpt_fields.get("Floating-point operations")),
        "jobThroughput": _as_float(ckpt_fields.get("Job throughput")),
        "cumulativeThroughput": _as_float(ckpt_fields.get("Cumulative throughput")),
        "jobs": jobs,
        "startTime": stamp(start_time) if start_time else None,
        "completed": completed,
        "lastExit": (
            {
                "iteration": last_exit.iteration,
                "reason": last_exit.fields.get("Reason"),
                "time": stamp(last_exit.time),
            }
            if last_exit
            else None
        ),
        "inPlaceRestarts": in_place,
        "hangs": hangs,
        "events": [ev.to_json() for ev in events],
    }


def get_start_time_from_progress_log(text: str, num_gpus: int) -> tuple[datetime | None, float]:
    """Megatron's `get_start_time_from_progress_log`, on the log's text.

    Scans the log in order. Any line with a different GPU count restarts the search, so the start time
    is that of the earliest `Starting job` with `num_gpus` GPUs whose run continued, without a change
    of GPU count, into the current one. The second value is the floating-point operations of the last
    checkpoint saved before that job started (0.0 if none): with it, cumulative throughput is
    `(flops_now - flops_at_start) / (elapsed * num_gpus)`. Unlike Megatron, async checkpoint lines
    count too (they are written only once durable). Returns (None, 0.0) when no such job is found
    (Megatron asserts).
    """
    start_time: datetime | None = None
    start_flops: float | None = None
    latest_flops = 0.0
    for ev in parse_progress(text):
        if ev.is_checkpoint:
            flops = _as_float(ev.fields.get("Floating-point operations"))
            if flops is not None:
                latest_flops = flops
        if ev.num_gpus != num_gpus:
            start_time = None
            start_flops = None
            continue
        if ev.event == STARTING_JOB and start_time is None:
            start_time = ev.time
            start_flops = latest_flops
    if start_time is None:
        return None, 0.0
    return start_time, float(start_flops or 0.0)


def last_checkpoint_flops(text: str) -> float:
    """Floating-point operations of the last saved checkpoint in the log (0.0 if none)."""
    latest = 0.0
    for ev in parse_progress(text):
        if ev.is_checkpoint:
            flops = _as_float(ev.fields.get("Floating-point operations"))
            if flops is not None:
                latest = flops
    return latest
