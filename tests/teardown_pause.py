"""`python -m tests.teardown_pause ARGS` is `python -m kubetron ARGS`, paused at the very end of the process.

The pause is in Python's finalization, after its atexit hooks and after it has put the signals it handled
back to their defaults (CPython's _PySignal_Fini): an object held only by this module's globals pauses in
its `__del__`, run when the interpreter clears the modules' dicts (this one, `__main__`, among the last).
It creates the file $KUBETRON_TEST_PAUSED, then waits until $KUBETRON_TEST_RESUME exists (at most 120 s).
By then the run's termination message and its progress log line ("Exiting job ... Completed") are written:
a SIGTERM sent in that window is the latest one a pod's trainer can get. (An atexit hook pauses too early:
a SIGTERM there still met the trainer's Python handler, while a real one a few hundred milliseconds later,
in torch's teardown, killed completed runs with -15.) The hook lives here, not in the trainer
(tests/test_launch_endings.py).
"""

from __future__ import annotations

import os
import sys
import time


class _PauseWhenCollected:
    """Pauses in `__del__`; everything it calls is bound now, as modules may be half torn down by then."""

    def __init__(self):
        self.paused, self.resume = os.environ["KUBETRON_TEST_PAUSED"], os.environ["KUBETRON_TEST_RESUME"]

    def __del__(self, _open=os.open, _close=os.close, _exists=os.path.exists, _sleep=time.sleep,
                _now=time.monotonic, _flags=os.O_CREAT | os.O_WRONLY):
        _close(_open(self.paused, _flags))
        deadline = _now() + 120
        while not _exists(self.resume) and _now() < deadline:
            _sleep(0.02)


if __name__ == "__main__":
    _pauser = _PauseWhenCollected()  # a global of __main__: released only when finalization clears it
    from kubetron.cli import main

    sys.argv[0] = "kubetron"
    raise SystemExit(main())  # argv from sys.argv: the process is the command, as `python -m kubetron`
