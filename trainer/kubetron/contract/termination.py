"""The pod's termination message (docs/CONTRACT.md): one line of JSON, at most 4 KiB.

Its shape, its encoding and its parser; the trainer writes it (kubetron.supervisor.termination_log).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TypedDict

from kubetron.contract.hang import HangReport

DEFAULT_TERMINATION_LOG = "/dev/termination-log"
ENV_VAR = "KUBETRON_TERMINATION_LOG"
MESSAGE_LIMIT = 4096  # bytes; the kubelet reads at most this much (the one definition of the limit)


class TerminationMessage(TypedDict, total=False):
    """What a trainer writes (docs/CONTRACT.md); only `exitCode` is always there."""

    exitCode: int
    reason: str  # exitcodes.NAMES[exitCode]
    message: str
    iteration: int | None
    trainIters: int | None
    lastCheckpoint: int | None  # the newest durable checkpoint's iteration this process knows of
    inPlaceRestarts: int  # torchrun's restarts of the gang inside its pods before this process, this attempt
    hang: HangReport  # exit 7 (Hung): the rank the pod's watchdog named (docs/recovery.md)


def parse_termination_message(text: str) -> TerminationMessage | None:
    """The trainer's one-line JSON; None for anything else (e.g. a log tail the kubelet put there)."""
    for line in reversed((text or "").strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("exitCode"), int):
            return data  # type: ignore[return-value]  # the keys beyond exitCode are read with .get
    return None


def encode_termination_message(payload: Mapping, limit: int = MESSAGE_LIMIT) -> bytes:
    """`payload` as one JSON line of at most `limit` bytes (newline included); shortens `message`."""
    data = dict(payload)

    def enc(d: dict) -> bytes:
        return (json.dumps(d, ensure_ascii=False, default=str, separators=(", ", ": ")) + "\n").encode("utf-8")

    out = enc(data)
    if len(out) <= limit:
        return out
    msg = str(data.get("message", ""))
    if msg:
        # Cut the message by the excess (bytes >= chars, so a few rounds at most).
        for _ in range(8):
            excess = len(out) - limit
            if excess <= 0:
                return out
            keep = max(0, len(msg) - excess - 3)
            msg = msg[:keep]
            data["message"] = msg + "..."
            out = enc(data)
            if keep == 0:
                break
        if len(out) <= limit:
            return out
    # Still too long (huge other fields): keep only the essentials.
    small = {k: data[k] for k in ("exitCode", "reason", "iteration", "lastCheckpoint") if k in data}
    small["message"] = str(payload.get("message", ""))[: limit // 4]
    out = enc(small)
    while len(out) > limit and small["message"]:
        small["message"] = small["message"][: len(small["message"]) // 2]
        out = enc(small)
    return out[:limit]
