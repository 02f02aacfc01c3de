"""Checks that read the code without running it: mypy over the operator, the trainer's contract and its
data, checkpoint, hf and training packages (the files and settings of pyproject.toml's [tool.mypy]; a cold
run takes about 50 s of CPU, torch's stubs most of it), test modules that share code only through helper
modules, and the shape of the two packages (tests/code_graph.py): no import cycle, no import against the
trainer's package order, no use of another module's private names, no constant defined twice, no patch of
another library outside kubetron/compat; the run's parts stay the composition root's (GlobalState is the forward
step's façade, the heartbeat is a listener the root builds, the checkpoint package is handed what it needs)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests import code_graph, typecheck

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


def test_the_typed_modules_type_check_clean(pytestconfig):
    """mypy, started when the session's tests were collected (tests/conftest.py), else now."""
    run = pytestconfig.stash.get(typecheck.STARTED, None) or typecheck.Run()
    code, out = run.result()
    assert code == 0, out
    assert "Success: no issues found" in out


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


# Strings two modules may both define, each for its own purpose (not a layout or contract constant).
SAME_TEXT_ON_PURPOSE = {
    "kubetron": "the program name of the umbrella CLI and of the operator's client commands it dispatches to, "
                "and the chart's default release name",
}


def test_no_import_cycle_in_the_trainer_or_the_operator():
    """An import inside a function counts: it hides a cycle from Python, not from the reader."""
    assert code_graph.cycles(code_graph.build()) == []


def test_the_trainers_packages_import_only_down_their_order():
    """tests/code_graph.py's TRAINER_ORDER (README's Layout shows it): nothing imports a package above its own,
    at module or function level, and every package has its place."""
    graph = code_graph.build()
    assert code_graph.unplaced(graph) == set()
    assert code_graph.back_arrows(graph) == set()


def test_the_order_check_finds_a_back_import(tmp_path):
    """A lower package that imports a higher one, even inside a function, is found; the other way is not."""
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "user.py").write_text("from pkg.low import base\n")
    (pkg / "low" / "base.py").write_text("def f():\n    from pkg.high import user\n    return user\n")
    graph = code_graph.build([pkg])
    assert code_graph.back_arrows(graph, ("__init__", "low", "high"), root="pkg") == {("pkg.low.base", "pkg.high.user")}
    assert code_graph.back_arrows(graph, ("__init__", "high", "low"), root="pkg") == {("pkg.high.user", "pkg.low.base")}
    assert code_graph.unplaced(graph, ("__init__", "low"), root="pkg") == {"high"}


def test_no_module_uses_another_modules_private_names():
    assert sorted(code_graph.build().private_uses) == []


def test_no_string_constant_is_defined_twice():
    """A layout name (the commit marker, the tokenizer folder, the termination log's path, ...) has one
    definition that every user imports, so the two halves cannot drift apart."""
    twice = {text: where for text, where in code_graph.string_constants(code_graph.build()).items()
             if len(where) > 1 and text not in SAME_TEXT_ON_PURPOSE}
    assert twice == {}


def test_only_the_compat_package_patches_other_libraries():
    """Third-party internals behind one seam each (the trainer's kubetron/compat, the operator's compat_kopf, both
    checked against the library's version): no other module assigns into a library."""
    patches = code_graph.library_patches(code_graph.build())
    assert [p for p in patches if not p.startswith(("kubetron.compat", "kubetron_operator.compat_kopf:"))] == []
    assert any(p.startswith("kubetron.compat.megatron_core.portable:") for p in patches)  # the check reads them


# What the operator's decisions may import: the standard library's pure parts, yaml (the job's config text),
# pydantic (the config schema) and the contract. No clock, no randomness, no network, no kopf, no logging.
PURE_IMPORTS = {"__future__", "collections", "dataclasses", "datetime", "typing", "math", "json", "hashlib",
                "functools", "re", "enum", "types", "difflib", "decimal", "copy", "yaml", "pydantic", "annotated_types"}
PURE_OPERATOR = ("kubetron_operator.decide", "kubetron_operator.observe", "kubetron_operator.job_status",
                 "kubetron_operator.policy")


def test_the_operators_decisions_are_pure():
    """decide() and the policy modules it calls take the time and the cluster through `Observed`: no operator
    module they import (directly or not) reads a clock, the network or the environment, or logs. What else they
    reach is the contract, which tests/test_contract_boundary.py keeps free of I/O."""
    graph = code_graph.build()
    roots = [m for m in graph.files if m.startswith(PURE_OPERATOR)]
    assert "kubetron_operator.policy.restart" in roots
    reached = set().union(*(graph.reachable(m) for m in roots))
    assert {m for m in reached if not m.startswith(("kubetron_operator", "kubetron.contract"))} == set()
    clock = (".now", ".utcnow", ".today", ".time", ".monotonic")
    impure = {m: sorted(graph.external.get(m, set()) - PURE_IMPORTS)
              + sorted(c for c in graph.calls.get(m, ()) if c.endswith(clock))
              for m in sorted(reached) if m.startswith("kubetron_operator")}
    assert {m: v for m, v in impure.items() if v} == {}


def test_the_checks_find_what_they_look_for(tmp_path):
    """The three checks above on a tiny package holding one of each fault."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text('MARKER = "metadata.json"\n\ndef f():\n    from pkg import b\n    return b._hidden\n')
    (pkg / "b.py").write_text('from pkg.a import f\nNAME = "metadata.json"\n_hidden = 1\n')
    (pkg / "d.py").write_text("from pkg import _ext\n")  # its own package's private part: allowed
    (pkg / "c.py").write_text("import time\nfrom pkg.b import _hidden\n\ndef g():\n    return time.monotonic()\n")
    graph = code_graph.build([pkg])
    assert code_graph.cycles(graph) == [["pkg.a", "pkg.b"]]
    assert sorted(graph.private_uses) == [("pkg.a", "pkg.b", "_hidden"), ("pkg.c", "pkg.b", "_hidden")]
    assert code_graph.string_constants(graph)["metadata.json"] == ["pkg.a.MARKER", "pkg.b.NAME"]
    assert graph.reachable("pkg.c") == {"pkg.a", "pkg.b", "pkg.c"}
    assert graph.external["pkg.c"] == {"time"} and "time.monotonic" in graph.calls["pkg.c"]


def test_the_patch_check_finds_each_kind_of_patch(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "own.py").write_text("import torch\n\nclass Box:\n    pass\n\nBox.size = torch.Size\nx = torch.ones(1)\n")
    (pkg / "patch.py").write_text(
        "import sys\nimport torch\nfrom megatron.core.tensor_parallel import mappings as m\nfrom pkg import own\n\n"
        "def install(model):\n    from megatron.core.transformer.moe.router import TopKRouter\n"
        "    own.Box.size = 1\n"  # its own package's: allowed
        "    torch.compile, m._gather = None, None\n    torch.backends.cudnn.benchmark = True\n"
        "    sys.modules['wandb'] = object()\n    model.rope.__class__ = object\n"
        "    setattr(TopKRouter, 'gating', None)\n    TopKRouter.count += 1\n")
    assert set(code_graph.library_patches(code_graph.build([pkg]))) == {
        "pkg.patch:9: torch.compile", "pkg.patch:9: m._gather", "pkg.patch:10: torch.backends.cudnn.benchmark",
        "pkg.patch:11: sys.modules['wandb']", "pkg.patch:12: model.rope.__class__", "pkg.patch:13: TopKRouter.<attr>",
        "pkg.patch:14: TopKRouter.count"}  # not own.py's, nor patch.py's own.Box.size


def test_test_modules_say_what_they_check_not_which_issue_asked():
    """A test module's name and docstrings describe behaviour; an issue number means nothing to a reader later."""
    cited = []
    for path in sorted((code_graph.REPO / "tests").rglob("*.py")):
        text = path.read_text()
        if re.search(r"issue_?\d", path.stem) or re.search(r"\b[Ii]ssues? \d+", text):
            cited.append(str(path.relative_to(code_graph.REPO)))
    assert cited == []


# The reference's GlobalState as a forward step sees it (Megatron Bridge's forward-step contract; README "Python API").
FACADE_FIELDS = {"cfg", "train_state", "timers"}
FACADE_PROPERTIES = {"tokenizer", "tensorboard_logger", "wandb_logger", "straggler_timer"}


def _class(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)


def test_global_state_holds_only_the_forward_step_facade():
    """GlobalState's fields are the façade's: cfg, train_state, timers, and the private ones behind the lazily built
    tokenizer and loggers. The run's parts (the checkpoint manager, the metrics logger, the signal handler, the rank,
    the device) are the composition root's `Run`, handed on explicitly, never reached through the state."""
    cls = _class(code_graph.REPO / "trainer" / "kubetron" / "training" / "state.py", "GlobalState")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    properties = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)
                  and any(isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list)}
    assert {f for f in fields if not f.startswith("_")} == FACADE_FIELDS
    assert {f.removeprefix("_") for f in fields if f.startswith("_")} <= FACADE_PROPERTIES  # only backing fields
    assert properties == FACADE_PROPERTIES


def test_only_the_composition_root_and_the_launcher_touch_the_heartbeat():
    """The heartbeat is one of the run's listeners (kubetron.events): the loop and the checkpoint manager emit
    events, the composition root builds the heartbeat that hears them, the launcher names its files."""
    graph = code_graph.build()
    users = {m for m, targets in graph.edges.items() if "kubetron.supervisor.heartbeat" in targets}
    assert users == {"kubetron.training.run", "kubetron.supervisor.launch"}


def _reads_environment(tree: ast.AST) -> list[int]:
    return sorted(n.lineno for n in ast.walk(tree)
            if (isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv", "environb"))
            or (isinstance(n, ast.ImportFrom) and n.module == "os"
                and any(a.name in ("environ", "getenv") for a in n.names)))


def test_the_checkpoint_package_reads_no_environment():
    """What a checkpoint does is the config's and its caller's: the save-time faults are a hook the CLI hands in
    (KUBETRON_CHAOS_KILL_AT), the pod's job id and restarts reach the progress log from the composition root."""
    package = code_graph.REPO / "trainer" / "kubetron" / "checkpoint"
    found = {str(p.relative_to(package)): lines for p in sorted(package.rglob("*.py"))
             if (lines := _reads_environment(ast.parse(p.read_text())))}
    assert found == {}
    assert _reads_environment(ast.parse("import os\nx = os.environ.get('A')\nfrom os import getenv\n")) == [2, 3]


def _module_tier(path: Path) -> str | None:
    """The tier a test module's `pytestmark = pytest.mark.<tier>` sets (tests/conftest.py TIERS), else None."""
    from tests.conftest import TIERS

    assigned = [node for node in ast.parse(path.read_text()).body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)]
    if not assigned:
        return None
    tiers = [m for m in re.findall(r"pytest\.mark\.(\w+)", ast.unparse(assigned[-1].value)) if m in TIERS]
    return tiers[0] if len(tiers) == 1 else None  # the last assignment is the one pytest reads


def test_every_test_module_has_a_tier():
    """`make test-fast` runs the unit tier, `make test` every tier: a module without a tier would run in none of
    the tiers but the whole suite. Set `pytestmark = pytest.mark.<tier>` (unit, trainer, process, cluster; the
    markers in pyproject.toml say what each holds), and mark a costlier test of a cheaper module by itself."""
    modules = sorted((code_graph.REPO / "tests").rglob("test_*.py"))
    assert len(modules) > 50
    assert [str(p.relative_to(code_graph.REPO)) for p in modules if _module_tier(p) is None] == []
    assert _module_tier(Path(__file__)) == "unit"
