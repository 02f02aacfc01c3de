"""The wheels a GPU machine lacks, pinned, in one folder (`make gpu-wheels`), and their install there.

The lent GPU machine (README "Notes for the next developer") has Python 3.12 and a CUDA torch, with numpy,
psutil, tensorboard and pyyaml, but no package index and not this project. Here, with network:

    python3 bench/gpu_wheels.py download --python-version 3.12 --dest .whl     # make gpu-wheels

fetches every wheel the trainer needs beyond that image, at the versions of constraints.txt, for that
Python. There, `bench/gpu_check.py --wheels .whl` (what `make gpu-check` runs) calls `install`: the
folder goes into a side directory, without dependencies and without an index, which the checks then
put first on PYTHONPATH. The project itself is not installed: its source tree is on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
# What the trainer imports that the GPU image lacks, with their own dependencies (botocore needs dateutil,
# six and urllib3; megatron-core needs packaging >= 24.2). typing-extensions: pydantic needs a newer one
# than an older image may have.
WHEELS = ("megatron-core", "packaging", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
          "typing-extensions", "boto3", "botocore", "s3transfer", "jmespath", "python-dateutil", "six", "urllib3")
# megatron-core 0.16.1 has only manylinux_2_28 wheels, pydantic-core manylinux_2_17 ones
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them: `pydantic_core` == `Pydantic-Core`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(constraints: Path = CONSTRAINTS, names: tuple[str, ...] = WHEELS) -> list[str]:
    """`name==version` for each of `names`, from the constraints file; a name it does not pin is an error
    (an unpinned name may resolve to anything, a placeholder release included)."""
    pinned = {}
    for line in constraints.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip()):
            pinned[canonical(m.group(1))] = m.group(2)
    missing = [n for n in names if canonical(n) not in pinned]
    if missing:
        raise SystemExit(f"gpu-wheels: {constraints.name} pins no version of {', '.join(missing)}")
    return [f"{n}=={pinned[canonical(n)]}" for n in names]


def download(python_version: str, dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()  # only this set, at these pins: an earlier download's other versions would install too
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--implementation", "cp", "--python-version", python_version,
           *(f"--platform={p}" for p in PLATFORMS), "--dest", str(dest), *pins()]
    rc = subprocess.call(cmd)
    if rc == 0:
        wheels = sorted(dest.glob("*.whl"))
        size = sum(w.stat().st_size for w in wheels) / 2**20
        print(f"gpu-wheels: {len(wheels)} wheels for Python {python_version} in {dest} ({size:.0f} MiB)")
    return rc


def install(wheels: Path, target: Path, python: str = sys.executable) -> None:
    """Install the folder's wheels into `target` (no index, no dependencies: the folder is the set)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"gpu-check: no wheels in {wheels}: run `make gpu-wheels` on a machine with network first")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--upgrade", "--target", str(target), *map(str, found)], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="fetch the pinned wheels for the GPU machine's Python")
    d.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default: %(default)s)")
    d.add_argument("--dest", type=Path, default=ROOT / ".whl", help="the wheel folder (default: .whl)")
    i = sub.add_parser("install", help="install a wheel folder into a side directory (no index, no deps)")
    i.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    i.add_argument("--target", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.command == "download":
        return download(args.python_version, args.dest)
    install(args.wheels, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
