"""`make test`: the whole suite, as two pytest processes side by side: tests/operator (the cluster tier: a control
plane of its own, the operator, pods as processes, mostly waiting on the cluster's clocks; and the operator's
unit tests) with two process-tier modules that mostly wait too (SIDE: the GPU machine's layout, its installs and
a save held past 30 s; the hang watchdog's timeouts), beside everything else (mostly computing). On 2 cores the
suite kept them busy about half of its time one after the other; side by side it takes the longer stream's time,
not the sum (the two streams are sized alike by their serial durations, about 1,050 s and 930 s).

The main stream prints as it goes; the side stream writes into `--side-log` and is printed whole once both
ended, its summary last. The exit status is the first non-zero one (pytest's codes). `--serial` runs one pytest
over everything instead (a machine with one core, a bisection). Arguments after `--` go to both pytest
processes, as do PYTEST_ADDOPTS.

    python -m tests.suite [--serial] [--side-log PATH] [-- PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIDE = ("tests/operator", "tests/test_gpu_layout.py", "tests/test_hang_watchdog.py")  # beside the rest
PORTS = {"side": "20000-26384", "rest": "26384-32768"}  # each stream's own (tests/ports.py)


def env_with_ports(stream: str) -> dict[str, str]:
    return {**os.environ, "KUBETRON_TEST_PORTS": PORTS[stream]}


def pytest_cmd(paths: list[str], extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", *paths, *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--serial", action="store_true", help="one pytest over every tier, one after the other")
    parser.add_argument("--side-log", type=Path, default=REPO / ".pytest-side.log",
                        help="where the side stream's output goes (printed at the end)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    if args.serial:
        return subprocess.call(pytest_cmd(["tests"], args.pytest_args), cwd=REPO)
    t0 = time.monotonic()
    with open(args.side_log, "w") as log:
        side = subprocess.Popen(pytest_cmd(list(SIDE), args.pytest_args), cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, env=env_with_ports("side"))
        try:
            print(f"tests.suite: {', '.join(SIDE)} run beside the rest, their output in {args.side_log} (printed "
                  "when both ended)", flush=True)
            rest = subprocess.call(pytest_cmd(["tests", *(f"--ignore={p}" for p in SIDE)], args.pytest_args),
                                   cwd=REPO, env=env_with_ports("rest"))
            rc = side.wait()
        except BaseException:
            side.terminate()
            side.wait()
            raise
    print("\n========== beside: " + ", ".join(SIDE) + " ==========", flush=True)
    sys.stdout.write(args.side_log.read_text(errors="replace"))
    print(f"\ntests.suite: the rest: exit {rest}; beside it: exit {rc}; {time.monotonic() - t0:.0f} s in all",
          flush=True)
    return next((c for c in (rest, rc) if c != 0), 0)


if __name__ == "__main__":
    raise SystemExit(main())
