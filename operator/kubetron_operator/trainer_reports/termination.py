"""The trainer's termination message (docs/CONTRACT.md): the one-line JSON a rank leaves in its container's
termination log, read from the pod's status (observe.PodView.from_pod), bounded and range-checked.

What a pod says is hostile input (kubetron_operator.untrusted): a message too big, too deep or with a number
out of range is refused (PodView.refused says why), and the pod is judged by its exit code alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubetron.contract.hang import HangReport, parse_report
from kubetron.contract.termination import MESSAGE_LIMIT, TerminationMessage

from kubetron_operator.untrusted import Untrusted, clean, count, load_json

REPORT_TEXT = {"phase": 32, "state": 32, "where": 300, "stacks": 512}  # characters kept of a hang report's strings


def trainer_message(text: str) -> tuple[TerminationMessage | None, str]:
    """The trainer's one-line JSON in a termination message (the last line that is one), checked: (the
    message, "") or, when it is refused, (None, why). (None, "") when there is none."""
    for line in reversed((text or "").strip().splitlines()):
        if not line.lstrip().startswith("{"):
            continue
        try:
            data = load_json(line, MESSAGE_LIMIT)
            if isinstance(data, dict) and isinstance(data.get("exitCode"), int):
                return _checked_termination(data), ""
        except Untrusted as exc:
            return None, f"its termination message was ignored: {exc}"
        except ValueError:
            continue  # a log line that starts with a brace
    return None, ""


def _checked_termination(data: Mapping[str, Any]) -> TerminationMessage:
    """The keys decide() reads, each checked (Untrusted when one is out of range); text made safe."""
    code = data["exitCode"]
    if isinstance(code, bool) or not 0 <= code <= 255:
        raise Untrusted("exitCode is not an exit code")
    out = TerminationMessage(exitCode=code)
    for key in ("iteration", "trainIters", "lastCheckpoint"):
        out[key] = count(data.get(key), key)
    restarts = count(data.get("inPlaceRestarts"), "inPlaceRestarts")  # capped by in_place_news at the job's limit
    if restarts is not None:
        out["inPlaceRestarts"] = restarts
    for key in ("reason", "message"):
        if isinstance(data.get(key), str):
            out[key] = clean(data[key])  # type: ignore[literal-required]
    report = parse_report(data.get("hang"))  # exit 7 (Hung): the rank the pods' watchdogs named
    if report is not None:
        for key in ("rank", "nodeRank", "localRank", "iteration", "ranks", "restart"):
            count(report[key], f"hang.{key}")  # type: ignore[literal-required]
        out["hang"] = capped(report)
    return out


def capped(report: HangReport) -> HangReport:
    """`report` with its strings as short as status and an event may carry them, control characters escaped (a
    pod's watchdog wrote it from its peers' keys in the job's rendezvous store, which anyone who reaches that
    store may write: docs/security.md)."""
    texts = {key: clean(report[key], limit) for key, limit in REPORT_TEXT.items()}  # type: ignore[literal-required]
    return HangReport(**{**report, **texts})  # type: ignore[typeddict-item]
