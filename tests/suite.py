"""`make test`: the whole suite, as two pytest processes side by side: the cluster tier (a control plane of its
own, the operator, pods as processes: mostly waiting on the cluster's clocks) beside the other three tiers
(unit, trainer, process: mostly computing). On 2 cores the suite kept them busy about half of its time one
after the other; side by side it takes the longer stream's time, not the sum.

The unit/trainer/process stream prints as it goes; the cluster stream writes into `--cluster-log` and is
printed whole once both ended, its summary last. The exit status is the first non-zero one (pytest's codes).
`--serial` runs one pytest over every tier instead (a machine with one core, a bisection). Arguments after `--`
go to both pytest processes, as do PYTEST_ADDOPTS.

    python -m tests.suite [--serial] [--cluster-log PATH] [-- PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import TIERS

REPO = Path(__file__).resolve().parent.parent
ALONE = "cluster"  # the tier that runs beside the others


def pytest_cmd(tiers: list[str], extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "tests", *(a for t in tiers for a in ("--tier", t)), *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--serial", action="store_true", help="one pytest over every tier, one after the other")
    parser.add_argument("--cluster-log", type=Path, default=REPO / ".pytest-cluster.log",
                        help="where the cluster stream's output goes (printed at the end)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    if args.serial:
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "tests", *args.pytest_args], cwd=REPO)
    t0 = time.monotonic()
    others = [t for t in TIERS if t != ALONE]
    with open(args.cluster_log, "w") as log:
        cluster = subprocess.Popen(pytest_cmd([ALONE], args.pytest_args), cwd=REPO, stdout=log,
                                   stderr=subprocess.STDOUT)
        try:
            print(f"tests.suite: the {ALONE} tier runs beside the others, its output in {args.cluster_log} "
                  "(printed when both ended)", flush=True)
            rest = subprocess.call(pytest_cmd(others, args.pytest_args), cwd=REPO)
            rc = cluster.wait()
        except BaseException:
            cluster.terminate()
            cluster.wait()
            raise
    print(f"\n========== the {ALONE} tier ==========", flush=True)
    sys.stdout.write(args.cluster_log.read_text(errors="replace"))
    print(f"\ntests.suite: {'+'.join(others)}: exit {rest}; {ALONE}: exit {rc}; "
          f"{time.monotonic() - t0:.0f} s in all", flush=True)
    return next((c for c in (rest, rc) if c != 0), 0)


if __name__ == "__main__":
    raise SystemExit(main())
