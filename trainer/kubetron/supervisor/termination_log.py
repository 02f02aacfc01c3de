"""Writing the pod's termination message (its shape and encoding: kubetron.contract.termination).

Used by the CLI (config errors), the launcher and, as one of the run's listeners (`TerminationReport`), by
`kubetron train` (every ending). Never raises: a failure to write the message must not change how the process exits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kubetron.contract import exitcodes
from kubetron.contract.termination import (
    DEFAULT_TERMINATION_LOG,
    ENV_VAR,
    TerminationMessage,
    encode_termination_message,
)
from kubetron.events import CheckpointDurable, Ended, Event, Started
from kubetron.supervisor.progress_io import in_place_restarts

IN_POD_VAR = "KUBERNETES_SERVICE_HOST"  # set in every container Kubernetes starts


def termination_log_path(path: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """`path` if given, else env KUBETRON_TERMINATION_LOG, else, in a Kubernetes pod (KUBERNETES_SERVICE_HOST
    set), /dev/termination-log when writable. Outside a pod nothing is written unless asked for: a laptop's
    /dev/termination-log is nobody's message."""
    if path:
        return path
    env = os.environ if environ is None else environ
    if env.get(ENV_VAR):
        return env[ENV_VAR]
    if env.get(IN_POD_VAR) and os.path.exists(DEFAULT_TERMINATION_LOG) \
            and os.access(DEFAULT_TERMINATION_LOG, os.W_OK):
        return DEFAULT_TERMINATION_LOG
    return None


def write_termination_message(payload: TerminationMessage, path: str | None = None) -> bool:
    """Write `payload` as the termination message (see `termination_log_path`); True if written.

    Never raises. The file is replaced, not appended to: the kubelet reports its whole content.
    """
    try:
        target = termination_log_path(path)
        if not target:
            return False
        data = encode_termination_message(payload)
        with open(target, "wb") as fh:
            fh.write(data)
        return True
    except Exception:  # noqa: BLE001 - by contract this never fails the caller
        return False


class TerminationReport:
    """A run's listener: at `Ended`, the termination message (exit code, reason, message, the iteration reached, the
    newest durable checkpoint this process knows of, the attempt's in-place restarts before it). `ended` is that
    ending, once it came."""

    def __init__(self, path: str | None, train_iters: int | None):
        self.path, self.train_iters = path, train_iters  # train_iters None: an evaluation, not a training job
        self.last_checkpoint: int | None = None
        self.ended: Ended | None = None

    def __call__(self, event: Event) -> None:
        match event:
            case Started(checkpoint=checkpoint) if checkpoint is not None:
                self.last_checkpoint = checkpoint.iteration
            case CheckpointDurable(checkpoint=checkpoint):
                self.last_checkpoint = checkpoint.iteration
            case Ended():
                self.ended = event
                write_termination_message({
                    "exitCode": event.code, "reason": exitcodes.NAMES[event.code], "iteration": event.iteration,
                    "trainIters": self.train_iters, "lastCheckpoint": self.last_checkpoint,
                    "inPlaceRestarts": in_place_restarts(), "message": event.message,
                }, self.path)
