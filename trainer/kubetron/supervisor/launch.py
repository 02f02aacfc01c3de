"""The trainer image's entry point: `python -m kubetron.launch [KUBETRON ARGS...]`.

Runs `torchrun -m kubetron ARGS` (default ARGS: `train --config $KUBETRON_CONFIG`) with the rendezvous
the operator put in the pod's environment (docs/CONTRACT.md): NNODES, NODE_RANK, NPROC_PER_NODE,
MASTER_ADDR, MASTER_PORT. Four things make it more than `exec torchrun`:

- It is PID 1 in the container, so it forwards SIGTERM/SIGINT to torchrun (which forwards them to the
  ranks); a preempted pod's trainer gets to finish its step and save. torchrun's own grace before it
  SIGKILLs the ranks is raised (`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, which kubetron.torchrun makes torch
  < 2.12 honour too), so the kubelet's terminationGracePeriodSeconds is the one limit.
- torchrun exits 1 whenever any rank fails, which would turn "preempted and saved" (75) into "crashed"
  (1). The launcher exits with the ranks' own code instead, so the operator's reading of the pod's
  exit code matches the contract's table.
- Each local rank writes its termination message to a file of its own (torchrun runs every rank
  through this module, which points KUBETRON_TERMINATION_LOG there and execs the trainer), so a rank
  that saw its peer die (5) cannot overwrite the message of the rank that caused it (say 3). The
  launcher then writes the root cause, one line, to the pod's real termination log.
- The pod's log ends with the trainer's own last line (`kubetron: error: train.x: ...`, `kubetron:
  SavedOnSignal: ...`), not torchrun's failure report: torchrun runs as `kubetron.torchrun`, which
  leaves that report out, and the launcher adds one line of its own only when no rank's termination
  message says why the run ended (a rank killed by a signal, a failed rendezvous).
- A pod stopped (SIGTERM) after its ranks completed exits 0, not torchrun's "stopped by a signal":
  every local rank wrote Completed, so there is nothing to restart.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from kubetron.contract import exitcodes
from kubetron.contract.hang import HangReport, parse_report
from kubetron.contract.hang import describe as describe_hang
from kubetron.contract.termination import DEFAULT_TERMINATION_LOG
from kubetron.supervisor.heartbeat import HEARTBEAT_ENV, STACKS_ENV
from kubetron.supervisor.termination_log import write_termination_message
from kubetron.supervisor.torchrun import (
    FAILURES_FILE,
    HANGS_FILE,
    RDZV_LOST_FILE,
    RDZV_ROUND_FILE,
    SHUTDOWN_TIMEOUT_ENV,
    describe_failure,
)
from kubetron.supervisor.torchrun import NODE_RANK_ENV as RDZV_NODE_RANK_ENV
from kubetron.supervisor.watchdog import heartbeat_path, stacks_path

DEFAULT_CONFIG = "/etc/kubetron/config.yaml"
MESSAGES_DIR_ENV = "KUBETRON_LAUNCH_MESSAGES"  # set by the launcher for its torchrun workers
TRAINER_MODULE_ENV = "KUBETRON_LAUNCH_MODULE"  # the module a worker runs (default: kubetron)
MAX_IN_PLACE_RESTARTS_ENV = "KUBETRON_MAX_IN_PLACE_RESTARTS"  # spec.maxInPlaceRestarts (docs/recovery.md)
# How soon the rendezvous drops an agent that stopped without leaving it (its pod deleted, its node gone): every
# agent writes a heartbeat each KEEP_ALIVE_S, and one missing for KEEP_ALIVE_S x KEEP_ALIVE_MISSED is dead. Until
# then a lost pod's replacement waits for the next round with the survivors (torch's default, 5 s x 3: up to 15 s
# of a replaced pod's recovery, docs/recovery.md). A live agent writes one each second while its ranks train and
# about each second in a rendezvous; one stalled longer is dropped, and rejoins (or, once the round formed, its
# ranks and the others' restart in place).
KEEP_ALIVE_S, KEEP_ALIVE_MISSED = 1, 3


def torchrun_argv(env: Mapping[str, str], args: Sequence[str], python: str = sys.executable,
                  module: str = "kubetron") -> list[str]:
    """The torchrun command line for this pod: one agent per pod, NPROC_PER_NODE ranks under it."""
    nnodes = int(env.get("NNODES", "1"))
    argv = [
        python, "-m", "kubetron.supervisor.torchrun",  # torchrun without its failure report (supervisor/torchrun.py)
        f"--nnodes={nnodes}",
        f"--nproc-per-node={env.get('NPROC_PER_NODE', '1')}",
        # Restarts of the gang inside its pods (docs/recovery.md); kubetron.torchrun restarts only the
        # ends a restart can cure. Beyond the bound the pod fails and the operator restarts the gang.
        f"--max-restarts={int(env.get(MAX_IN_PLACE_RESTARTS_ENV) or 0)}",
    ]
    if nnodes > 1 or env.get("MASTER_ADDR"):
        argv += rendezvous_args(env)
    else:
        argv.append("--standalone")
    trainer_args = list(args) or ["train", "--config", env.get("KUBETRON_CONFIG", DEFAULT_CONFIG)]
    return argv + ["-m", module, *trainer_args]


def rendezvous_args(env: Mapping[str, str]) -> list[str]:
    """A c10d rendezvous hosted by the NODE_RANK 0 pod's agent at MASTER_ADDR:MASTER_PORT.

    Unlike a static one, it re-forms across the pods after an in-place restart (docs/recovery.md):
    each restart is a new round that every agent joins. Group ranks follow NODE_RANK
    (kubetron.torchrun), so global rank 0 stays in the pod the operator reads.
    """
    node_rank = env.get("NODE_RANK", "0")
    host = node_rank == "0"
    argv = [
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', '29500')}",
        f"--rdzv-id={(env.get('KUBETRON_JOB_ID') or 'kubetron').replace('/', '-')}",
        f"--rdzv-conf=is_host={str(host).lower()},keep_alive_interval={KEEP_ALIVE_S},"
        f"keep_alive_max_attempt={KEEP_ALIVE_MISSED}",
    ]
    if host:  # the ranks' own store is rank 0's, reached by the name the others already resolve
        argv.append(f"--local-addr={env.get('MASTER_ADDR', '127.0.0.1')}")
    return argv


def read_messages(path: str | Path) -> list[dict]:
    """The JSON termination messages in a file (unparseable lines are skipped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    messages = []
    for line in lines:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict) and isinstance(message.get("exitCode"), int):
            messages.append(message)
    return messages


def root_cause(messages: Sequence[dict]) -> dict | None:
    """The message that says why the ranks stopped: a rank's own failure beats "a peer died"."""
    failed = [m for m in messages if m["exitCode"] != exitcodes.COMPLETED]
    own = [m for m in failed if m["exitCode"] != exitcodes.PEER_FAILURE]
    return (own or failed or list(messages) or [None])[0]


def resolve_exit_code(torchrun_rc: int, message: dict | None, stopped_after_completion: bool = False) -> int:
    """The pod's exit code: torchrun's 0, else the ranks' own code, else torchrun's.

    `stopped_after_completion`: the pod was stopped by a signal after every local rank wrote
    Completed (torchrun then reports the signal): 0.
    """
    if torchrun_rc == 0 or stopped_after_completion:
        return 0
    if message is not None and 0 < message["exitCode"] < 256:
        return message["exitCode"]
    if torchrun_rc < 0:  # torchrun itself was killed by a signal
        return 128 - torchrun_rc
    return torchrun_rc


def run(argv: Sequence[str], env: Mapping[str, str], received: list[int] | None = None) -> int:
    """Run torchrun as a child, forwarding termination signals (appended to `received`); return its
    exit status."""
    child = subprocess.Popen(list(argv), env=dict(env))

    def forward(signum: int, _frame: object) -> None:
        if received is not None:
            received.append(signum)
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    return child.wait()


def describe_failures(failures: Sequence[dict]) -> str | None:
    """The first failed rank as torchrun saw it, for a run no rank explained."""
    return describe_failure(failures[0]) if failures else None


def read_failures(path: str | Path) -> list[dict]:
    try:
        failures = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return failures if isinstance(failures, list) else []


def last_hang(path: str | Path) -> HangReport | None:
    """The newest hang the agent recorded (kubetron.torchrun.HANGS_FILE) when it ended the run: no restart left."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    try:
        report = parse_report(json.loads(lines[-1])) if lines else None
    except ValueError:
        return None
    return report if report is not None and report["restart"] == 0 else None


def read_note(path: str | Path, limit: int = 512) -> str:
    """A one-line note the agent left (kubetron.torchrun.RDZV_LOST_FILE), bounded; "" when there is none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return " ".join(fh.read(limit).split())
    except OSError:
        return ""


def rendezvous_lost_message(why: str, saved: dict | None) -> dict:
    """The pod's termination message when its agent lost the gang's rendezvous while the ranks trained and
    stopped them (they saved on that SIGTERM): a peer failure, not a preemption; nothing sent this pod a signal,
    another pod's agent ended first (its own end says why)."""
    at = f" at iteration {saved['iteration']}" if saved and isinstance(saved.get("iteration"), int) else ""
    return {"exitCode": exitcodes.PEER_FAILURE, "reason": exitcodes.reason(exitcodes.PEER_FAILURE),
            **({"iteration": saved["iteration"]} if at else {}),
            "message": f"this pod's agent lost the gang's rendezvous while its ranks trained ({why}); it stopped "
                       f"them and they saved{at}: another pod's agent ended first"}


def rendezvous_round_message(why: str) -> dict:
    """The pod's termination message when its agent could not form a rendezvous round and no rank of it ran (no
    rank said why): the pod that hosts the rendezvous, or another pod's agent, went away while this one waited, a
    peer failure (the operator waits for the other pod's own end: its node lost, its eviction), not this pod's."""
    return {"exitCode": exitcodes.PEER_FAILURE, "reason": exitcodes.reason(exitcodes.PEER_FAILURE),
            "message": f"this pod's agent could not form the gang's rendezvous round ({why}): the pod that hosts it, "
                       f"or another pod's agent, went away while it waited"}


def pod_ending(rc: int, messages: Sequence[dict], nproc: int, rank_messages: Sequence[dict] = (),
               failures: Sequence[dict] = (), hung: HangReport | None = None, lost: str = "", no_round: str = "",
               received: Sequence[int] = ()) -> tuple[int, dict | None]:
    """The pod's exit code and termination message from what torchrun and its ranks left: torchrun's status
    `rc`, the ranks' messages (`rank_messages`, those in the launcher's directory, and every one, `messages`),
    torchrun's failed ranks, a hang with no restart left, the agent's notes (`lost`: the rendezvous lost while
    the ranks trained; `no_round`: no round formed while none ran) and the signals this pod received."""
    message = root_cause(messages)
    completed = (bool(received) and len(rank_messages) == nproc
                 and all(m["exitCode"] == exitcodes.COMPLETED for m in rank_messages))
    code = resolve_exit_code(rc, message, stopped_after_completion=completed)
    if code == exitcodes.SAVED_ON_SIGNAL and lost and not received:
        message, code = rendezvous_lost_message(lost, message), exitcodes.PEER_FAILURE
    elif code != 0 and message is None and no_round and not received:
        message, code = rendezvous_round_message(no_round), exitcodes.PEER_FAILURE
    if code != 0 and hung is not None and not received:  # the watchdog stopped a hung gang, no restart left
        message, code = hang_message(hung), exitcodes.HUNG
    if code != 0 and (message is None or message["exitCode"] != code):
        # No rank said why (rendezvous failure, import error, a rank SIGKILLed): say what we know, in
        # the pod's log (torchrun's own report is left out) and in the termination message.
        why = describe_failures(failures) or f"torchrun exited with status {rc}"
        message = {"exitCode": code, "reason": exitcodes.reason(code),
                   "message": f"{why} and no rank wrote a termination message for it; see the pod's log"}
    return code, message


def hang_message(hung: HangReport) -> dict:
    """The pod's termination message after a hang with no in-place restart left (exit 7, Hung)."""
    where = f"; stacks in {hung['stacks']}" if hung["stacks"] else ""
    return {"exitCode": exitcodes.HUNG, "reason": exitcodes.reason(exitcodes.HUNG), "iteration": hung["iteration"],
            "message": f"the gang hung: {describe_hang(hung)}{where}", "hang": hung}


def worker(args: Sequence[str]) -> None:
    """One rank under torchrun: give it its own termination log, then become the trainer (exec, so
    torchrun's signals reach it directly)."""
    local_rank = os.environ.get("LOCAL_RANK", "0")
    log = os.environ["KUBETRON_TERMINATION_LOG"] = os.path.join(os.environ[MESSAGES_DIR_ENV], f"rank-{local_rank}.json")
    Path(log).unlink(missing_ok=True)  # a restarted rank: its predecessor's message no longer says why the run ends
    # The hang watchdog's files (kubetron.watchdog): this rank's heartbeat and stacks, its predecessor's gone.
    beat = os.environ[HEARTBEAT_ENV] = heartbeat_path(os.environ[MESSAGES_DIR_ENV], local_rank)
    stacks = os.environ[STACKS_ENV] = stacks_path(os.environ[MESSAGES_DIR_ENV], local_rank)
    for path in (beat, stacks):
        Path(path).unlink(missing_ok=True)
    module = os.environ.get(TRAINER_MODULE_ENV) or "kubetron"
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get(MESSAGES_DIR_ENV) and "LOCAL_RANK" in os.environ:
        worker(args)  # does not return
    env = dict(os.environ)
    # torchrun SIGKILLs the ranks 30 s after forwarding SIGTERM unless told otherwise; a checkpoint
    # save can take longer. The pod's grace period bounds it instead.
    env.setdefault(SHUTDOWN_TIMEOUT_ENV, "86400")  # kubetron.torchrun makes older torch honour it too
    log_path = env.get("KUBETRON_TERMINATION_LOG") or DEFAULT_TERMINATION_LOG
    try:
        messages_dir = tempfile.mkdtemp(prefix="kubetron-launch-")
    except OSError:  # no writable temp dir: the ranks share the pod's log, last writer wins
        messages_dir = None
    if messages_dir:
        env[MESSAGES_DIR_ENV] = messages_dir
    env[RDZV_NODE_RANK_ENV] = env.get("NODE_RANK", "0")
    command = torchrun_argv(env, args, module="kubetron.supervisor.launch" if messages_dir else "kubetron")
    print("kubetron.launch:", " ".join(command), file=sys.stderr, flush=True)
    received: list[int] = []
    rc = run(command, env, received)

    rank_messages, failures, hung, lost, no_round = [], [], None, "", ""
    if messages_dir:
        for path in sorted(Path(messages_dir).glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1])):
            rank_messages += read_messages(path)
        failures = read_failures(Path(messages_dir, FAILURES_FILE))
        hung = last_hang(Path(messages_dir, HANGS_FILE))
        lost = read_note(Path(messages_dir, RDZV_LOST_FILE))
        no_round = read_note(Path(messages_dir, RDZV_ROUND_FILE))
        shutil.rmtree(messages_dir, ignore_errors=True)
    messages = rank_messages + read_messages(log_path)  # a rank whose config names its own termination_log
    code, message = pod_ending(rc, messages, int(env.get("NPROC_PER_NODE", "1")), rank_messages, failures, hung,
                               lost, no_round, received)
    if message is not None and message is not root_cause(messages):  # the launcher's own words: in the log too
        print(f"kubetron.launch: {message['message']}", file=sys.stderr, flush=True)
    if message is not None:
        write_termination_message(message, log_path)  # one line, at most 4 KiB, still valid JSON
    return code


if __name__ == "__main__":
    raise SystemExit(main())
