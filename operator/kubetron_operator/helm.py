"""Helm for the chart's lint/template/package steps, without a helm binary.

Uses the `helm-python-sdk` package (Helm v4's Go SDK behind a C ABI, in the dev extra), which lints,
renders and packages charts offline. The operator image does not ship it: this module is a developer
and CI tool that lives beside the operator because the chart installs the operator.

    python -m kubetron_operator.helm lint charts/kubetron [--set watchNamespaces={a,b}]
    python -m kubetron_operator.helm template charts/kubetron [--set ...] [-f values.yaml]
    python -m kubetron_operator.helm package charts/kubetron dist/
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

RELEASE = "kubetron"
NAMESPACE = "kubetron-system"
SEVERITY = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}


def _sdk():
    try:
        import helm_python
    except ImportError as e:  # the dev extra is not installed
        raise RuntimeError("helm-python-sdk is required: pip install -e '.[dev]'") from e
    return helm_python


def lint(chart_dir: str | os.PathLike, values: dict[str, Any] | None = None) -> list[str]:
    """`helm lint --strict`: the findings that fail it ("SEVERITY path: message"); empty when clean.

    INFO findings (such as "icon is recommended") are not failures and are left out.
    """
    report = _sdk().lint(os.fspath(chart_dir), values, strict=True)
    problems = [
        f"{SEVERITY.get(m['severity'], m['severity'])} {m['path']}: {m['error'].strip()}"
        for m in report["messages"]
        if m["severity"] >= 2
    ]
    # `errors` repeats the ERROR messages; it stands alone only if a failure came without one.
    return problems or [f"ERROR {e.strip()}" for e in report.get("errors", [])]


def template(
    chart_dir: str | os.PathLike,
    values: dict[str, Any] | None = None,
    *,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
    include_crds: bool = False,
) -> list[dict]:
    """`helm template`: every rendered manifest as a dict, in template order (NOTES.txt left out).

    Values are checked against values.schema.json first, as `helm install` does (HelmValuesError).
    """
    helm = _sdk()
    with helm.Chart.load(os.fspath(chart_dir)) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values, name=name, namespace=namespace, is_install=True)
        crds = chart.crds if include_crds else []
    manifests: list[dict] = []
    for crd in crds:
        manifests += [doc for doc in yaml.safe_load_all(crd["data"]) if doc]
    for path in sorted(rendered):
        if path.endswith(".txt"):
            continue
        manifests += [doc for doc in yaml.safe_load_all(rendered[path]) if doc]
    return manifests


def notes(chart_dir: str | os.PathLike, values: dict[str, Any] | None = None, **kw: Any) -> str:
    """The rendered NOTES.txt a user sees after `helm install`."""
    with _sdk().Chart.load(os.fspath(chart_dir)) as chart:
        rendered = chart.render(values, name=kw.get("name", RELEASE),
                                namespace=kw.get("namespace", NAMESPACE), is_install=True)
    return next((text for path, text in rendered.items() if path.endswith("NOTES.txt")), "")


def package(chart_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """`helm package`: write `<name>-<version>.tgz` into out_dir (created if missing); return its path."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return Path(_sdk().package(os.fspath(chart_dir), destination=os.fspath(out_dir)))


def _values(args: argparse.Namespace) -> dict[str, Any] | None:
    """Merge -f files then --set expressions, as helm does (later wins)."""
    helm = _sdk()
    merged: dict[str, Any] = {}
    for path in args.values or []:
        _merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    for expression in args.set or []:
        _merge(merged, helm.parse_set_string(expression))
    return merged or None


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetron_operator.helm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("lint", "template"):
        p = sub.add_parser(command)
        p.add_argument("chart")
        p.add_argument("-f", "--values", action="append", help="values YAML file (repeatable)")
        p.add_argument("--set", action="append", help="helm --set expression (repeatable)")
        if command == "template":
            p.add_argument("--name", default=RELEASE)
            p.add_argument("--namespace", "-n", default=NAMESPACE)
            p.add_argument("--include-crds", action="store_true")
    p = sub.add_parser("package")
    p.add_argument("chart")
    p.add_argument("out_dir")
    args = parser.parse_args(argv)

    helm = _sdk()
    try:
        if args.command == "lint":
            problems = lint(args.chart, _values(args))
            for problem in problems:
                print(problem, file=sys.stderr)
            print(f"{args.chart}: {'FAILED' if problems else 'ok'} (helm lint --strict)")
            return 1 if problems else 0
        if args.command == "template":
            manifests = template(args.chart, _values(args), name=args.name, namespace=args.namespace,
                                 include_crds=args.include_crds)
            print(yaml.safe_dump_all(manifests, sort_keys=False), end="")
            return 0
        print(package(args.chart, args.out_dir))
        return 0
    except helm.HelmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
