"""Two (or more) pods' entry points on localhost, for tests of the launcher and torchrun's agent
(tests/test_in_place_restart.py, tests/test_hang_watchdog.py): `python -m kubetron.launch` processes with
NNODES/NODE_RANK/MASTER_PORT as the operator sets them, real torchrun with gloo, one store."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from kubetron.contract.recovery import PEER_TOKEN_ENV, POD_IP_ENV, SNAPSHOT_DIR_ENV
from kubetron.supervisor import launch

from tests.multirank.runner import free_port
from tests.trainer_utils import LineReader, is_trainer, pod_env

REPO = Path(__file__).resolve().parents[2]


def start_pods(tmp_path: Path, args: list[str], max_restarts: int = 3, nodes: int = 2,
               nproc: int = 1, memory: bool = False, **extra: str) -> list[subprocess.Popen]:
    """`memory`: each pod gets a memory volume of its own, `pod<N>/memory` (KUBETRON_SNAPSHOT_DIR), and the
    job's token for the copies on peers (docs/recovery.md)."""
    port = str(free_port())
    return [start_pod(tmp_path / f"pod{rank}", args, rank, port, max_restarts, nodes, nproc, memory, **extra)
            for rank in range(nodes)]


def start_pod(directory: Path, args: list[str], rank: int, port: str, max_restarts: int = 3, nodes: int = 2,
              nproc: int = 1, memory: bool = False, **extra: str) -> subprocess.Popen:
    """One pod's launcher (NODE_RANK `rank`, the rendezvous at `port`), its files in `directory`."""
    directory.mkdir()
    volume = {SNAPSHOT_DIR_ENV: str(directory / "memory"), PEER_TOKEN_ENV: "the-jobs-token",
              POD_IP_ENV: "127.0.0.1"} if memory else {}
    env = {**pod_env(directory, nproc), "NNODES": str(nodes), "NODE_RANK": str(rank),
           "MASTER_PORT": port, "KUBETRON_JOB_ID": "default/tiny/0",
           launch.MAX_IN_PLACE_RESTARTS_ENV: str(max_restarts), **volume, **extra}
    return subprocess.Popen([sys.executable, "-m", "kubetron.launch", *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill_pod(pod: subprocess.Popen) -> None:
    """SIGKILL a pod's every process, as a lost node does (torchrun starts each rank in a session of its own)."""
    processes = psutil.Process(pod.pid).children(recursive=True)
    os.killpg(pod.pid, signal.SIGKILL)
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.kill()
    pod.wait()


def trainer_pid(pods: list[subprocess.Popen], rank: int) -> int:
    """Global rank `rank`'s trainer process (`python -m kubetron train ...` under torchrun), not a launcher."""
    for pod in pods:
        for child in psutil.Process(pod.pid).children(recursive=True):
            if is_trainer(child) and child.environ().get("RANK") == str(rank):
                return child.pid
    raise AssertionError(f"no trainer process of rank {rank}")


def collect(pod: subprocess.Popen, lines: list[str]) -> LineReader:
    """The pod's output lines appended to `lines` as they come."""
    return LineReader(pod, lines.append)


def finish(pods: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """The pods' exit codes, None for one still running after `timeout` (then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pod.poll() is None for pod in pods):
        time.sleep(0.1)
    codes = [pod.poll() for pod in pods]
    for pod in pods:
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
            pod.wait()
    return codes


def run_to_end(pods: list[subprocess.Popen], timeout: float) -> tuple[list[int | None], list[list[str]], str]:
    """Collect two pods' output until they end (`finish`): their codes, their lines, and one log of both."""
    outs: list[list[str]] = [[] for _ in pods]
    readers = [collect(pod, out) for pod, out in zip(pods, outs, strict=True)]
    codes = finish(pods, timeout=timeout)
    for r in readers:
        r.join(timeout=10)
    return codes, outs, "".join(outs[0]) + "\n----- pod 1 -----\n" + "".join(outs[1])


