"""Launch `kubetron train` as 1 process or under `torchrun --nproc-per-node N` (CPU, gloo) for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kubetron.contract import exitcodes

from tests.trainer_utils import CONSUMED_RE, TINY, HeldReader, env_for, free_port, iteration_at_least

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ITERS = 40
GBS = 8
COMMON = [f"train.train_iters={ITERS}", f"train.global_batch_size={GBS}", "logger.log_interval=1",
          "validation.eval_interval=null", "checkpoint.most_recent_k=-1"]
TP2 = ["model.tensor_model_parallel_size=2"]
LOSS_TOL = 2e-3
"""|loss difference| per iteration allowed after a resharded resume (tests/test_multirank.py says why)."""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    rank_dir: Path
    codes: dict[int, int] = field(default_factory=dict)
    terms: dict[int, dict] = field(default_factory=dict)

    def consumed_at(self, iteration: int) -> int | None:
        for m in CONSUMED_RE.finditer(self.stdout):
            if int(m.group(1)) == iteration:
                return int(m.group(2))
        return None

    def tail(self) -> str:
        return (self.stdout[-2500:] + "\n--- stderr ---\n" + self.stderr[-4000:])


def _collect(rank_dir: Path, nproc: int) -> tuple[dict[int, int], dict[int, dict]]:
    codes, terms = {}, {}
    for r in range(nproc):
        f = rank_dir / f"exit-{r}"
        if f.exists():
            codes[r] = int(f.read_text())
        t = rank_dir / f"termination-{r}.log"
        if t.exists():
            try:
                terms[r] = json.loads(t.read_text())
            except ValueError:
                pass
    return codes, terms


def command(args: list[str], nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "tests.multirank.worker", *args]
    return [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
            "-m", "tests.multirank.worker", *args]


def environment(rank_dir: Path, **extra) -> dict:
    """`env_for`, plus the worker's folder for each rank's pid, exit code and termination message."""
    return env_for(rank_dir, OMP_NUM_THREADS="1", KUBETRON_TEST_RANK_DIR=str(rank_dir), **extra)


def launch(args: list[str], rank_dir: Path, nproc: int = 2, timeout: float = 400, **env) -> Result:
    """Run to the end; per-rank exit codes and termination messages come from the worker's files."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(command(args, nproc), check=False, env=environment(rank_dir, **env), cwd=REPO,
                       capture_output=True,
                       text=True, timeout=timeout, start_new_session=True)
    codes, terms = _collect(rank_dir, nproc)
    return Result(p.returncode, p.stdout, p.stderr, rank_dir, codes, terms)


def launch_and_signal(args: list[str], rank_dir: Path, at_iteration: int, ranks: list[int], nproc: int = 2,
                      sig=signal.SIGTERM, timeout: float = 400, **env) -> Result:
    """Start, and once the last rank logs iteration >= at_iteration send `sig` to the given ranks (the ranks share
    torchrun's stdout: a write blocked on the held pipe holds the gang, `HeldReader`)."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen(command(args, nproc), env=environment(rank_dir, **env), cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    lines: list[str] = []
    reader = HeldReader(p, lines.append, iteration_at_least(at_iteration))
    try:
        with reader.held(timeout, explain=lambda: "".join(lines)[-2000:]):
            for r in ranks:
                os.kill(int((rank_dir / f"pid-{r}").read_text()), sig)
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    reader.join(timeout=10)
    codes, terms = _collect(rank_dir, nproc)
    return Result(p.returncode, "".join(lines), p.stderr.read(), rank_dir, codes, terms)


def start_plain_ranks(args: list[str], rank_dir: Path, hold_last_at: Callable[[str], bool],
                      world: int = 2) -> tuple[list[subprocess.Popen], HeldReader]:
    """The operator's launch without torchrun: MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK per process, each
    rank's output in rank_dir/out-<rank>. The last rank (it logs the iterations) writes through a
    `HeldReader` held at the first line that passes `hold_last_at`: act on the ranks in `with reader.held(...)`."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for r in range(world):
        env = environment(rank_dir, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=world, RANK=r,
                          LOCAL_RANK=r)
        with open(rank_dir / f"out-{r}", "w") as out:
            procs.append(subprocess.Popen(command(args, 1), env=env, cwd=REPO, start_new_session=True,
                                          stdout=out if r < world - 1 else subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))

    def append_to_last(line: str) -> None:
        with open(rank_dir / f"out-{world - 1}", "a") as out:
            out.write(line)
    return procs, HeldReader(procs[-1], append_to_last, hold_last_at)


def collect(rank_dir: Path, nproc: int):
    return _collect(rank_dir, nproc)


def tb_scalars(logdir: Path, tag: str = "lm loss") -> dict[int, float]:
    from tests.trainer_utils import tb_scalars as _tb

    return _tb(logdir, tag)


# -- the runs' command line and checks ----------------------------------------------------------------

def args(store, *extra, load=None, tb=None) -> list[str]:
    """`kubetron train` of the tiny GPT for ITERS iterations, saving to (and resuming from) `store`."""
    out = ["train", "--config", TINY, *COMMON, f"checkpoint.save={store}",
           f"checkpoint.load={load if load is not None else store}",
           f"logger.tensorboard_dir={tb if tb is not None else f'{store}/tb'}"]
    return out + list(extra)


def ok(r: Result, code: int = exitcodes.COMPLETED, nproc: int = 2):
    """Every rank exited `code`."""
    assert r.codes == {i: code for i in range(nproc)}, r.tail()


def close(a: dict[int, float], b: dict[int, float], steps, tol: float) -> float:
    """The largest |a - b| over `steps`, asserted <= tol."""
    worst = max(abs(a[i] - b[i]) for i in steps)
    print(f"max |loss difference| over iterations {steps.start}..{steps.stop - 1}: {worst:.3g}")
    assert worst <= tol, {i: (a[i], b[i]) for i in steps}
    return worst
