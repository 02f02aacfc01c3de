"""The import graph and module-level constants of the two packages, read from source (AST), not by importing.

Used by tests/test_static_checks.py: import cycles (at module and function level: an import inside a
function is an edge too), imports against the trainer's package order (TRAINER_ORDER), uses of another
module's `_private` names, module constants that define the same string twice, and assignments into other
libraries (monkeypatches).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = (REPO / "trainer" / "kubetron", REPO / "operator" / "kubetron_operator")

TRAINER_ORDER = (
    "__init__",  # kubetron/__init__.py: the version
    "contract",  # the typed, torch-free, I/O-free half the operator shares (docs/CONTRACT.md)
    "events",  # a run's life as typed events, and the listeners' protocol (imports nothing of kubetron)
    "compat",  # megatron-core/torch adaptations: imports nothing of kubetron but the contract
    "storage",  # a directory or s3://, transactions that commit with a marker
    "supervisor",  # the pod's supervisor: launcher, torchrun, hang watchdog, heartbeat, progress log, termination log
    "data",  # tokenizers, datasets, loaders, preprocessing
    "config",  # the contract's config, resolved where the trainer runs (reads the tokenizer's files)
    "checkpoint",  # the on-store format, the formats, the manager: handed what it loads, never the trainer's
    "hf",  # Hugging Face import/export: reads and writes checkpoints, converts weights
    "training",  # model, loop, evaluation, and the run built from everything below
    "plan",  # the memory estimate and layout search
    "launch",  # `python -m kubetron.launch`, the pod's command (the launcher is supervisor's)
    "client", "client_cli", "cli", "__main__",  # the commands
)
"""The trainer's packages (`kubetron.<first component>`), lowest first: a module imports only from its own
package and the packages before it. A lower package is handed what it needs (a loader, a filter) instead."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@dataclass
class Graph:
    files: dict[str, Path] = field(default_factory=dict)  # module name -> file
    edges: dict[str, set[str]] = field(default_factory=dict)  # module -> modules it imports
    private_uses: set[tuple[str, str, str]] = field(default_factory=set)  # (user, owner, name)
    external: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level names it imports from outside
    calls: dict[str, set[str]] = field(default_factory=dict)  # module -> dotted names it calls (`datetime.now`)

    def reachable(self, module: str) -> set[str]:
        """`module` and every module it imports, directly or not."""
        seen, todo = {module}, [module]
        while todo:
            for nxt in self.edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    def module_of(self, dotted: str) -> str | None:
        """The longest known module that `dotted` names or lies in."""
        while dotted and dotted not in self.files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(graph: Graph, module: str, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str | None, str]]:
    """(imported module, name taken from it or None, local alias) for each name of an import statement."""
    if isinstance(node, ast.Import):
        for a in node.names:
            yield a.name, None, a.asname or a.name.partition(".")[0]
        return
    base = node.module or ""
    if node.level:
        here = module.split(".") if graph.files[module].name == "__init__.py" else module.split(".")[:-1]
        here = here[:len(here) - node.level + 1]
        base = ".".join(here + ([node.module] if node.module else []))
    for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in graph.files:
            yield sub, None, a.asname or a.name
        else:
            yield base, a.name, a.asname or a.name


def node_is_relative(node: ast.Import | ast.ImportFrom) -> bool:
    return isinstance(node, ast.ImportFrom) and bool(node.level)


def build(packages: Iterable[Path] = PACKAGES) -> Graph:
    graph = Graph()
    for root in packages:
        for path in sorted(root.rglob("*.py")):
            graph.files[_module_name(path, root)] = path
    for module, path in graph.files.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target, name, alias in _targets(graph, module, node):
                owner = graph.module_of(target)
                if owner is None:
                    if not node_is_relative(node):
                        graph.external.setdefault(module, set()).add(target.partition(".")[0])
                    continue
                if owner == module:
                    continue
                graph.edges.setdefault(module, set()).add(owner)
                if name is None and owner == target:
                    aliases[alias] = owner
                if name is not None and _private(name) and owner != module.rpartition(".")[0]:
                    # (a package's own private parts, e.g. a C extension beside its modules, are its to use)
                    graph.private_uses.add((module, owner, name))
                elif name is None and _private(target.rpartition(".")[2]):
                    graph.private_uses.add((module, owner, target))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                graph.calls.setdefault(module, set()).add(ast.unparse(node.func))
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and aliases.get(node.value.id) not in (None, module)):
                graph.private_uses.add((module, aliases[node.value.id], node.attr))
    return graph


def library_patches(graph: Graph) -> list[str]:
    """`module:line: target` for each assignment into another library: `sys.modules[...] =`, `x.__class__ =`,
    and an attribute set (`=`, `+=`, `setattr`) on a name imported from outside the packages or below it
    (`mappings._fn =`, `torch.compile =`, `SomeClass.attr =`)."""
    found = []
    for module, path in graph.files.items():
        tree = ast.parse(path.read_text(), str(path))
        outside = _outside_names(graph, module, tree)
        for node in ast.walk(tree):
            found += [f"{module}:{node.lineno}: {ast.unparse(t)}" for t in _assigned(node) if _patches(t, outside)]
    return found


def _outside_names(graph: Graph, module: str, tree: ast.Module) -> set[str]:
    """The local names `module`'s imports (at any level) bind to modules or objects of other libraries."""
    return {alias for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
            and not node_is_relative(node) for target, _, alias in _targets(graph, module, node)
            if graph.module_of(target) is None}


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets `node` assigns to (tuples unpacked); `setattr(obj, ...)` as `obj.<attr>`."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
        targets = [ast.Attribute(value=node.args[0], attr="<attr>", ctx=ast.Store())]
    else:
        return []
    while any(isinstance(t, ast.Tuple | ast.List) for t in targets):
        targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple | ast.List) else [t])]
    return targets


def _patches(target: ast.expr, outside: set[str]) -> bool:
    if isinstance(target, ast.Subscript):
        return ast.unparse(target.value) == "sys.modules"
    if not isinstance(target, ast.Attribute):
        return False
    if target.attr == "__class__":
        return True
    root = target.value
    while isinstance(root, ast.Attribute):
        root = root.value
    return isinstance(root, ast.Name) and root.id in outside


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph.files):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_of(module: str) -> str:
    """The package of TRAINER_ORDER (or of any order over one root) that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def unplaced(graph: Graph, order: tuple[str, ...] = TRAINER_ORDER, root: str = "kubetron") -> set[str]:
    """The packages under `root` that `order` does not name."""
    return {package_of(m) for m in graph.files if m.split(".")[0] == root} - set(order)


def back_arrows(graph: Graph, order: tuple[str, ...] = TRAINER_ORDER, root: str = "kubetron") -> set[tuple[str, str]]:
    """(importer, imported) module pairs under `root` where a package imports one that `order` puts after it."""
    rank = {name: i for i, name in enumerate(order)}
    return {(module, target) for module, targets in graph.edges.items() if module.split(".")[0] == root
            for target in targets if target.split(".")[0] == root
            and rank[package_of(target)] > rank[package_of(module)]}


def string_constants(graph: Graph) -> dict[str, list[str]]:
    """Module-level `UPPER_NAME = "text"` definitions: text -> ["module.NAME", ...]."""
    out: dict[str, list[str]] = {}
    for module, path in graph.files.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                value, names = node.value, node.targets
            elif isinstance(node, ast.AnnAssign):
                value, names = node.value, [node.target]
            else:
                continue
            if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
                continue
            for target in names:
                if isinstance(target, ast.Name) and target.id.isupper():
                    out.setdefault(value.value, []).append(f"{module}.{target.id}")
    return out
