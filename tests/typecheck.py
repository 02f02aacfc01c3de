"""mypy over the typed modules (pyproject.toml's [tool.mypy]), as tests/test_static_checks.py checks it.

A cold run takes about a minute of one core (torch's stubs), so tests/conftest.py starts it when the session's
tests are collected, at low priority: it runs beside the tests that wait on servers and processes, and the
check only waits for what is left of it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK = "test_static_checks.py::test_the_typed_modules_type_check_clean"


class Run:
    """One mypy process; `result()` waits for it: (exit status, its output)."""

    def __init__(self) -> None:
        # As CI runs it: the packages as installed (editable), not through a PYTHONPATH a developer may have
        # set, which changes how mypy finds them (and what it reports).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.out = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "mypy"], cwd=REPO, env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: os.nice(10))

    def result(self, timeout: float = 300) -> tuple[int, str]:
        code = self.proc.wait(timeout)
        self.out.seek(0)
        return code, self.out.read()


STARTED = pytest.StashKey[Run]()  # the session's Run, in the pytest config's stash
