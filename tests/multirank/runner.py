"""Launch `kubetron train` as 1 process or under `torchrun --nproc-per-node N` (CPU, gloo) for tests."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kubetron.contract import exitcodes

from tests.trainer_utils import CONSUMED_RE, TINY, env_for, free_port

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
    for _ in range(3):
        p = subprocess.run(command(args, nproc), check=False, env=environment(rank_dir, **env), cwd=REPO,
                           capture_output=True, text=True, timeout=timeout, start_new_session=True)
        codes, terms = _collect(rank_dir, nproc)
        # torchrun could not listen on the free port it was given (another process took it meanwhile: a
        # loaded machine running other suites); no rank started, so launching again changes nothing else
        if codes or "EADDRINUSE" not in p.stderr:
            break
    return Result(p.returncode, p.stdout, p.stderr, rank_dir, codes, terms)


def fault_at(iteration: int, sig: str = "TERM", rank: int | None = None) -> dict[str, str]:
    """The environment that has the ranks (or only global rank `rank`) send themselves SIG<sig> once iteration
    `iteration` is done (kubetron.cli.chaos_from_env, `step@<k>`): the run's own event, no printed line read."""
    from kubetron.cli import CHAOS_KILL_AT_ENV, CHAOS_RANK_ENV, CHAOS_SIGNAL_ENV

    return {CHAOS_KILL_AT_ENV: f"step@{iteration}", CHAOS_SIGNAL_ENV: sig,
            **({CHAOS_RANK_ENV: str(rank)} if rank is not None else {})}


def faults_by_life(*faults: tuple[str, str], rank: int | None = None, arm: Path | None = None) -> dict[str, str]:
    """The environment for faults of a worker, in order: (`step@<k>`, `step@<r>%<m>` or a save point, its signal),
    one per life; with `arm`, each once, in whichever life runs when the file <arm>-<i> exists
    (kubetron.cli.chaos_from_env)."""
    from kubetron.cli import CHAOS_ARM_ENV, CHAOS_KILL_AT_ENV, CHAOS_RANK_ENV, CHAOS_SIGNAL_ENV

    return {CHAOS_KILL_AT_ENV: ",".join(at for at, _ in faults), CHAOS_SIGNAL_ENV: ",".join(sig for _, sig in faults),
            **({CHAOS_RANK_ENV: str(rank)} if rank is not None else {}),
            **({CHAOS_ARM_ENV: str(arm)} if arm is not None else {})}


def start_plain_ranks(args: list[str], rank_dir: Path, world: int = 2,
                      env_of: Callable[[int], dict] = lambda rank: {}) -> list[subprocess.Popen]:
    """The operator's launch without torchrun: MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK per process, each
    rank's output in rank_dir/out-<rank>, rank r's environment extended by `env_of(r)`."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for r in range(world):
        env = environment(rank_dir, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=world, RANK=r,
                          LOCAL_RANK=r, **env_of(r))
        with open(rank_dir / f"out-{r}", "w") as out:
            procs.append(subprocess.Popen(command(args, 1), env=env, cwd=REPO, start_new_session=True,
                                          stdout=out, stderr=subprocess.STDOUT, text=True))
    return procs


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
