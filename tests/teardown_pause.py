"""`python -m tests.teardown_pause ARGS` is `python -m kubetron ARGS`, paused at the very end of the process.

An atexit hook registered before kubetron runs (so it runs after everything kubetron registers) creates
the file $KUBETRON_TEST_PAUSED, then waits until $KUBETRON_TEST_RESUME exists (at most 120 s). By then
the run's termination message and its progress log line ("Exiting job ... Completed") are written: a
SIGTERM sent in that window is the latest one a pod's trainer can get. The hook lives here, not in the
trainer (tests/test_launch_endings.py).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path


def _pause() -> None:
    Path(os.environ["KUBETRON_TEST_PAUSED"]).touch()
    resume, deadline = Path(os.environ["KUBETRON_TEST_RESUME"]), time.monotonic() + 120
    while not resume.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    atexit.register(_pause)
    from kubetron.cli import main

    sys.argv[0] = "kubetron"
    raise SystemExit(main())  # argv from sys.argv: the process is the command, as `python -m kubetron`
