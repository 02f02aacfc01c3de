"""The operator and the trainer's torch-free contract modules type-check clean: mypy over the files and
with the settings of pyproject.toml's [tool.mypy] (a cold run takes about 10 s on 2 cores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_operator_and_contract_modules_type_check_clean():
    p = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Success: no issues found" in p.stdout
