"""The trainer's side of the progress log (its format is kubetron.contract.progress): what a pod's
environment says about the lines it writes, reading a store's log back, and `kubetron progress STORE`
(also `python -m kubetron.supervisor.progress_io`)."""

from __future__ import annotations

import json
import os
import sys

from kubetron.contract.hang import CAUSE_ENV, HANGS_ENV, HangReport, RestartCause, parse_cause, parse_hangs
from kubetron.contract.progress import (
    CHECKPOINT_EVENTS,
    JOB_ID_ENV,
    PROGRESS_FILE,
    RESTART_COUNT_ENV,
    STARTING_JOB,
    ProgressSummary,
    as_int,
    parse_progress,
    summarize_events,
)
from kubetron.contract.termination import MESSAGE_LIMIT
from kubetron.contract.times import format_duration, parse_stamp


def job_id() -> str:
    """The job id written into every line: env `KUBETRON_JOB_ID` (`<namespace>/<job>/<attempt>`) or ""."""
    return os.environ.get(JOB_ID_ENV, "")


def in_place_restarts() -> int:
    """How often torchrun has restarted this process's gang inside its pods, this attempt (0 outside torchrun)."""
    return as_int(os.environ.get(RESTART_COUNT_ENV)) or 0


def hangs() -> tuple[int, HangReport | None]:
    """Of those restarts, how many followed a hang, and the newest hang's report (the agent's, kubetron.watchdog)."""
    return parse_hangs(os.environ.get(HANGS_ENV))


def restart_cause() -> RestartCause | None:
    """The rank whose crash caused the newest other in-place restart (the agent's, kubetron.torchrun)."""
    try:
        return parse_cause(json.loads(os.environ.get(CAUSE_ENV) or "null"))
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------------
# Reading a store's log


def _split_location(location: str) -> tuple[str, str]:
    """(store root, key) for a store location or a location naming progress.txt itself."""
    stripped = location.rstrip("/")
    if stripped.rsplit("/", 1)[-1] == PROGRESS_FILE:
        return stripped[: -len(PROGRESS_FILE)].rstrip("/"), PROGRESS_FILE
    return location, PROGRESS_FILE


def _open_store(url: str):
    try:
        from kubetron.storage import open_store
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise RuntimeError(
            f"cannot read {url}: kubetron.storage is not importable ({exc}); "
            "reading an s3:// store needs the operator or trainer extras (boto3)"
        ) from exc
    return open_store(url)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def read_progress_text(location: str, store=None) -> str:
    """The text of `<location>/progress.txt` ("" when there is none yet).

    `location` is a local directory, an `s3://bucket/prefix` store, or either naming progress.txt itself.
    With `store` (an object from `kubetron.storage.open_store`) the file is read from it instead.
    """
    if store is not None:
        key = PROGRESS_FILE
        if not store.exists(key):
            return ""
        return _decode(store.read_bytes(key))
    if location.startswith("s3://"):
        root, key = _split_location(location)
        opened = _open_store(root)
        if not opened.exists(key):
            return ""
        return _decode(opened.read_bytes(key))
    path = location
    if location.startswith("file://"):
        path = location[len("file://") :]
    if not os.path.isfile(path):
        path = os.path.join(path, PROGRESS_FILE)
    try:
        with open(path, "rb") as f:
            return _decode(f.read())
    except (FileNotFoundError, NotADirectoryError):
        return ""


def summarize(location: str) -> ProgressSummary:
    """`summarize_events` of the store's progress log, plus `"store": location`."""
    summary = summarize_events(parse_progress(read_progress_text(location)))
    summary["store"] = location
    return summary


# --------------------------------------------------------------------------------------------------
# The human summary (`kubetron progress STORE`; the JSON with --json)


def _rate_points(events: list[dict]) -> list[tuple[int, float, int | None]]:
    """(iteration, epoch seconds, tokens) where the last job started and at each checkpoint it saved since."""
    points: list[tuple[int, float, int | None]] = []
    tokens_at: dict[int, int | None] = {0: 0}
    for ev in events:
        it, when = as_int(ev["fields"].get("Iteration")), parse_stamp(ev["time"])
        if it is None or when is None:
            continue
        if ev["event"] == STARTING_JOB:
            points = [(it, when.timestamp(), tokens_at.get(it))]
        elif ev["event"] in CHECKPOINT_EVENTS:
            tokens_at[it] = as_int(ev["fields"].get("Tokens"))
            points.append((it, when.timestamp(), tokens_at[it]))
    return points


def _speed(summary: ProgressSummary) -> tuple[str, str]:
    """(tokens/s, ETA) of the last job, from its last two points (its start or a checkpoint); "?" unknown."""
    points = _rate_points(summary.get("events", []))
    if len(points) < 2 or points[-1][1] <= points[-2][1]:
        return "?", "done" if summary["completed"] else "?"
    (i0, t0, k0), (i1, t1, k1) = points[-2], points[-1]
    tokens = f"{(k1 - k0) / (t1 - t0):,.0f}" if k0 is not None and k1 is not None else "?"
    left = (summary["trainIters"] or 0) - i1
    if summary["completed"]:
        return tokens, "done"
    return tokens, format_duration(left * (t1 - t0) / (i1 - i0)) if i1 > i0 and left > 0 else "?"


def format_summary(summary: ProgressSummary) -> str:
    """A few lines for a person: where the run is, its last checkpoint, speed and ETA, restarts, how it ended."""
    it, total = summary["iteration"], summary["trainIters"]
    where = f"iteration {'?' if it is None else it}/{'?' if total is None else total}"
    if it is not None and total:
        where += f" ({100 * it // total}%)"
    ckpt = summary["lastCheckpoint"]
    saved = "none" if ckpt is None else f"iteration {ckpt['iteration']} at {ckpt['time']}"
    tokens, eta = _speed(summary)
    starts, in_place = max(summary["jobs"] - 1, 0), sum(summary["inPlaceRestarts"].values())
    lines = [f"{summary.get('store', 'store')}: {where}{', completed' if summary['completed'] else ''}",
             f"  last checkpoint: {saved}", f"  speed: {tokens} tokens/s, ETA {eta}",
             f"  restarts: {starts + in_place} ({starts} new start(s), {in_place} in place)"]
    last = summary["lastExit"]
    if last is not None:
        lines.append(f"  last exit: {last['reason']} at iteration {last['iteration']} ({last['time']})")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# `kubetron progress STORE`


def main(argv: list[str] | None = None) -> int:
    """`kubetron progress STORE` (also `python -m kubetron.supervisor.progress_io STORE`): print the summary as JSON.

    `--termination-log PATH` also writes it, compact and within the termination message's limit, to PATH (a
    pod's /dev/termination-log: a pod that reads a store reports through its termination message).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    brief = False
    if "--no-events" in args:
        args.remove("--no-events")
        brief = True
    termination_log = None
    if "--termination-log" in args:
        i = args.index("--termination-log")
        termination_log = args[i + 1] if i + 1 < len(args) else ""
        del args[i:i + 2]
    if len(args) != 1 or termination_log == "":
        print("usage: kubetron progress [--no-events] [--termination-log PATH] STORE", file=sys.stderr)
        return 2
    summary = summarize(args[0])
    if brief:
        summary.pop("events", None)
    print(json.dumps(summary, indent=2))
    if termination_log:
        _write_termination_log(termination_log, summary)
    return 0


def _write_termination_log(path: str, summary: ProgressSummary) -> None:
    """One JSON line that fits Kubernetes' limit: the whole summary, else the fields a resume needs."""
    text = json.dumps(summary, separators=(",", ":"))
    if len(text.encode()) > MESSAGE_LIMIT:
        keep = ("lastCheckpoint", "iteration", "trainIters", "completed")
        text = json.dumps({k: summary.get(k) for k in keep}, separators=(",", ":"))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
