"""The boundary between the two halves (docs/CONTRACT.md): the operator imports only `kubetron.contract` of
the trainer, the contract imports neither torch nor boto3 and does no I/O, and the trainer imports nothing
of the operator (only the umbrella CLI dispatches to it, lazily)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "trainer" / "kubetron" / "contract"
OPERATOR = ROOT / "operator" / "kubetron_operator"
TRAINER = ROOT / "trainer" / "kubetron"

# Imports every contract module, then every operator module, with torch blocked; reports what got loaded.
PROBE = """
import importlib, json, pkgutil, sys
sys.modules["torch"] = None  # any `import torch` now fails
import kubetron.contract

def names(package):
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__, package.__name__ + "."))

def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] in ("kubetron", "kubetron_operator", "boto3",
                                                                "botocore", "torch") and sys.modules[m] is not None)

report = {"contract": names(kubetron.contract)}
for name in report["contract"]:
    importlib.import_module(name)
report["after_contract"] = loaded()
import kubetron_operator
report["operator"] = names(kubetron_operator)
for name in report["operator"]:
    importlib.import_module(name)
report["after_operator"] = loaded()
print(json.dumps(report))
"""


@pytest.mark.process
def test_operator_loads_only_the_contract_and_the_contract_no_torch_boto3_or_storage():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.splitlines()[-1])
    assert {"kubetron.contract.config", "kubetron.contract.live", "kubetron.contract.progress"} <= set(
        report["contract"])
    assert "kubetron_operator.handlers" in report["operator"]
    assert report["after_contract"] == ["kubetron", "kubetron.contract", *report["contract"]]
    trainer_side = [m for m in report["after_operator"] if m.split(".")[0] == "kubetron"
                    and m != "kubetron" and not m.startswith("kubetron.contract")]
    assert trainer_side == []
    assert not [m for m in report["after_operator"] if m.split(".")[0] == "torch"]


# What a contract module must not call or import: it reads no file, environment, process or network.
FORBIDDEN_MODULES = {"subprocess", "socket", "urllib", "http", "shutil", "tempfile", "pathlib", "importlib",
                     "boto3", "botocore", "torch", "kubetron_operator", "kubetron.storage"}
FORBIDDEN_OS = {"environ", "environb", "getenv", "putenv", "access", "listdir", "scandir", "makedirs", "mkdir",
                "remove", "unlink", "rename", "replace", "stat", "walk", "cpu_count", "system", "popen", "open"}
FORBIDDEN_OS_PATH = {"exists", "isfile", "isdir", "islink", "getsize", "getmtime", "realpath", "abspath",
                     "expanduser"}


def _io_in(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in FORBIDDEN_MODULES or node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("open", "__import__"):
            found.append(f"{node.func.id}()")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in FORBIDDEN_OS:
            found.append(f"os.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_OS_PATH \
                and isinstance(node.value, ast.Attribute) and node.value.attr == "path":
            found.append(f"os.path.{node.attr}")
    return found


def test_contract_modules_do_no_io():
    offences = {str(p.relative_to(ROOT)): _io_in(ast.parse(p.read_text(), str(p))) for p in CONTRACT.glob("*.py")}
    assert len(offences) >= 8
    assert {path: found for path, found in offences.items() if found} == {}
    # the scan itself sees what it looks for
    sample = "import os, subprocess\nopen('x')\nos.environ.get('A')\nos.path.exists('y')\nos.path.join('z')"
    seen = _io_in(ast.parse(sample))
    assert sorted(seen) == ["open()", "os.environ", "os.path.exists", "subprocess"]


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) of every import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, id(node) in top))
    return out


def test_the_trainer_imports_nothing_of_the_operator_and_the_operator_only_the_contract():
    trainer = {str(p.relative_to(ROOT)): [(m, top) for m, top in _imports(p) if m.split(".")[0] == "kubetron_operator"]
               for p in TRAINER.rglob("*.py")}
    trainer = {path: found for path, found in trainer.items() if found}
    # none: the umbrella CLI loads `kubetron operator` and `kubetron render` by name, in those commands
    # (cli._operator_part); `kubetron submit/status/logs/delete` are kubetron.client_cli, on kubetron.client
    assert trainer == {}
    operator = {str(p.relative_to(ROOT)): [m for m, _ in _imports(p) if m == "kubetron" or (
        m.startswith("kubetron.") and not m.startswith("kubetron.contract"))] for p in OPERATOR.rglob("*.py")}
    assert {path: found for path, found in operator.items() if found} == {}
