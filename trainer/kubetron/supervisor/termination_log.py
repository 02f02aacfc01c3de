"""Writing the pod's termination message (its shape and encoding: kubetron.contract.termination).

Used by the CLI (config errors), the launcher and the training loop (every exit). Never raises: a
failure to write the message must not change how the process exits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kubetron.contract.termination import (
    DEFAULT_TERMINATION_LOG,
    ENV_VAR,
    TerminationMessage,
    encode_termination_message,
)

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
