"""constraints.txt (what `make` and the operator image install) agrees with pyproject.toml's ranges, and
is what this venv runs; the newest kopf the ranges allow is tested in tests/operator/test_on_kube.py."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            out[canonicalize_name(name)] = version
    return out


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def test_every_pin_is_inside_the_pyproject_ranges():
    pinned, bad = pins(), []
    for req in requirements():
        if req.marker and not req.marker.evaluate():
            continue
        version = pinned.get(canonicalize_name(req.name))
        if version and not req.specifier.contains(version, prereleases=True):
            bad.append(f"{req.name}=={version} (pyproject: {req.specifier})")
    assert not bad, f"constraints.txt disagrees with pyproject.toml: {bad}; run `make constraints`"


def test_every_operator_and_core_requirement_is_pinned():
    pinned = pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [Requirement(r).name for r in project["dependencies"] + project["optional-dependencies"]["operator"]]
    assert not [n for n in names if canonicalize_name(n) not in pinned]


def test_kopf_has_an_upper_bound():
    (kopf,) = [r for r in requirements() if r.name == "kopf"]
    assert any(s.operator == "<" for s in kopf.specifier), "kopf needs an upper bound (a major release may break us)"


def test_the_ranges_of_adapted_libraries_are_the_ones_their_adaptations_were_checked_against():
    """pip installs only versions whose internals kubetron's adaptations were read against (else the trainer
    or the operator refuses to start on what pip chose)."""
    from kubetron.compat import megatron_core
    from kubetron.compat import torch as torch_compat
    from kubetron_operator import compat_kopf

    checked = {"kopf": compat_kopf.CHECKED_TEXT, "megatron-core": megatron_core.CHECKED, "torch": torch_compat.CHECKED}
    ranges: dict[str, set[str]] = {}
    for r in requirements():
        if r.name in checked:
            ranges.setdefault(r.name, set()).add(str(r.specifier))
    assert {name: {str(SpecifierSet(spec))} for name, spec in checked.items()} == ranges


def test_this_venv_runs_the_pinned_operator_stack():
    pinned = pins()
    for name in ("kopf", "kubernetes", "aiohttp"):
        assert importlib.metadata.version(name) == pinned[name], f"{name}: venv differs from constraints.txt"


def test_installs_use_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    assert "PINNED := -c constraints.txt" in makefile
    assert len(re.findall(r"\$\(PIP\) \$\(PINNED\) -e", makefile)) == 2
    dockerfile = (ROOT / "Dockerfile").read_text()
    operator_stage = dockerfile[dockerfile.index("AS operator"):dockerfile.index("AS trainer")]
    assert "-c /tmp/constraints.txt" in operator_stage and "source=constraints.txt" in operator_stage
    assert "!constraints.txt" in (ROOT / ".dockerignore").read_text().splitlines()
