"""Checks that read the code without running it: mypy over the operator and the trainer's torch-free
contract modules (the files and settings of pyproject.toml's [tool.mypy]; a cold run takes about 11 s of
CPU), and test modules that share code only through helper modules."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_operator_and_contract_modules_type_check_clean():
    p = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Success: no issues found" in p.stdout


IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", re.M)


def _imported_modules(path: Path) -> set[str]:
    return {a or b for a, b in IMPORT.findall(path.read_text())}


def test_no_module_imports_a_test_module():
    """Shared test code lives in helper modules (tests/trainer_utils.py, inprocess.py, ...): importing a
    test_*.py module ties one test file to another and runs its module-level code (fixtures, marks) twice."""
    offenders = [f"{path.relative_to(REPO)}: {module}"
                 for folder in ("tests", "bench") for path in sorted((REPO / folder).rglob("*.py"))
                 for module in _imported_modules(path) if module.rsplit(".", 1)[-1].startswith("test_")]
    assert not offenders, offenders
