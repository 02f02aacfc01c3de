"""`python -m kubetron.torchrun ARGS`: torchrun (`torch.distributed.run`, same arguments) as
`kubetron.launch` runs it, quiet about the endings the ranks report themselves.

Plain torchrun ends a failed run with its own report after the ranks' output: a log line per failed
rank, a `ChildFailedError` traceback and a banner (or a `SignalException` traceback when it was
stopped by SIGTERM). In a pod that buries the one line the trainer printed (`kubetron: error: ...`,
`kubetron: SavedOnSignal: ...`) under forty lines that say nothing more. This runs torchrun's own
`run()` and leaves the report to the launcher: the ranks' failures (rank, exit status, signal) go
to a JSON file in the launcher's messages directory, and the launcher says, in one line, what no
rank's termination message explains. Exit status: 0 when the ranks succeeded, 1 when one failed,
128 + N when torchrun itself was stopped by signal N.

In-place restarts (docs/recovery.md): run with `--max-restarts=N`, torchrun restarts its worker group
after a failure, up to N times. Only ends that a restart can cure are restarted
(`exitcodes.restartable_in_place`): a failed group with any other end (config error, divergence,
SIGTERM saved, ...) is not restarted, and the pod ends as without restarts; its agent closes the
rendezvous, so the other pods' agents, restarting after the peer failure their ranks saw, end too (one
line, exit 1; the launcher then exits with their ranks' PeerFailure). Each restart is appended, one
JSON line, to `RESTARTS_FILE` in the launcher's messages directory.

How torch's elastic agent and rendezvous are adapted lives in `kubetron.compat.torch.elastic` (checked
against the torch versions it names; on any other torch, `main` refuses in one line, exit 2, before adapting
anything). The rules it is handed are here: `Recovery`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kubetron.contract import exitcodes
from kubetron.contract.errors import ConfigError
from kubetron.contract.hang import CAUSE_ENV, HANGS_ENV, HangReport, RestartCause
from kubetron.contract.hang import describe as describe_hang
from kubetron.contract.progress import JOB_ID_ENV
from kubetron.supervisor.watchdog import Rank, Watchdog, override_from_env, store_from_args

if TYPE_CHECKING:
    from kubetron.compat.torch.elastic import Round
    from kubetron.supervisor.peers import Peers

FAILURES_FILE = "torchrun-failures.json"  # in the launcher's messages directory (KUBETRON_LAUNCH_MESSAGES)
NODE_RANK_ENV = "KUBETRON_RDZV_NODE_RANK"  # set by the launcher with a c10d rendezvous: this node's group rank
RESTARTS_FILE = "torchrun-restarts.jsonl"  # ditto: one line per in-place restart of the local workers
HANGS_FILE = "torchrun-hangs.jsonl"  # ditto: one HangReport per hung gang (kubetron.watchdog)
# ditto: the agent lost the gang's rendezvous while its ranks trained, and stopped them (torch's agent SIGTERMs its
# workers on any error): why, in one line. The ranks save on that SIGTERM; the launcher reports a peer failure.
RDZV_LOST_FILE = "torchrun-rendezvous-lost.txt"
# ditto: the agent could not form a rendezvous round while no rank of it ran (the pod that hosts the rendezvous, or
# another pod's agent, went away while this one waited in a round): why, in one line. The launcher reports a peer
# failure (before, exit 1, a TrainerError counted against backoffLimit for a node lost under the other pod).
RDZV_ROUND_FILE = "torchrun-rendezvous-round.txt"


def failure_records(failures) -> list[dict]:
    """torchrun's {global rank: ProcessFailure} as JSON-able dicts, first failure first."""
    out = []
    for rank, f in sorted(failures.items(), key=lambda item: item[1].timestamp):
        out.append({"rank": rank, "localRank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
                    "signal": f.signal_name() if f.exitcode < 0 else None})
    return out


def describe_failure(f: dict) -> str:
    """One failed rank as torchrun saw it: `rank 1 (local rank 0, pid 42) was killed by SIGKILL`."""
    how = f"was killed by {f['signal']}" if f.get("signal") else f"exited with status {f['exitcode']}"
    return f"rank {f['rank']} (local rank {f['localRank']}, pid {f['pid']}) {how}"


def _write_failures(failures, name: str = FAILURES_FILE, mode: str = "w") -> None:
    _write_note(name, json.dumps(failure_records(failures)) + "\n", mode)


def _write_note(name: str, text: str, mode: str = "w") -> None:
    """`text` into file `name` of the launcher's messages directory; without one, or on an error, nothing (the
    launcher falls back to torchrun's exit status)."""
    directory = os.environ.get("KUBETRON_LAUNCH_MESSAGES")
    if directory:
        with contextlib.suppress(OSError), open(os.path.join(directory, name), mode, encoding="utf-8") as fh:
            fh.write(text)


def restartable(failures) -> bool:
    """Whether the failed local ranks ended in a way an in-place restart can cure.

    Ranks killed by SIGTERM/SIGINT are left out: once one rank fails, torchrun SIGTERMs its siblings
    itself (a preemption's SIGTERM reaches torchrun first, which then stops without restarting).
    """
    def signal_name(f):
        return f.signal_name() if f.exitcode < 0 else None

    causes = [f for f in failures.values() if signal_name(f) not in ("SIGTERM", "SIGINT")]
    return bool(causes) and all(exitcodes.restartable_in_place(f.exitcode, signal_name(f)) for f in causes)


class Recovery:
    """kubetron's rules for the rounds of torchrun's agent (`kubetron.compat.torch.elastic.AgentHooks`):
    a failed worker group is restarted in place only when `restartable`, each restart recorded; with the
    hang watchdog `dog`, every round is handed to it, the monitor loop polls it (it stops the ranks of a
    hung gang; the monitor then sees them fail), and a gang it stopped is restarted as hung (its report
    instead of the kill)."""

    def __init__(self, dog: Watchdog | None = None, peers: Peers | None = None) -> None:
        self.dog = dog
        self.peers = peers  # the memory snapshots' copies on other pods (kubetron.supervisor.peers)
        self.workers_running = False  # the newest monitor tick saw every worker running

    def before_start(self, local_ranks: list[int]) -> None:
        if self.dog is None:
            return
        self.dog.forget_files(local_ranks)  # the previous round's
        cause = self.dog.cause()  # what ended the previous round, when a rank of some pod did
        if cause is not None:
            os.environ[CAUSE_ENV] = json.dumps(cause)  # the new ranks' (rank 0 reports it)

    def started(self, round_: Round) -> None:
        if self.peers is not None:
            self.peers.new_round(round_.store, int(os.environ.get(NODE_RANK_ENV) or 0), round_.group_world_size,
                                 [w.global_rank for w in round_.workers], round_.group_world_size * len(round_.workers))
        if self.dog is not None:
            self.dog.new_round([Rank(w.global_rank, w.local_rank, w.pid) for w in round_.workers], round_.store,
                               round_.group_world_size, round_.restarts_done, round_.restarts_left)

    def healthy(self) -> None:
        self.workers_running = True
        if self.peers is not None:
            self.peers.learn_addresses()
        if self.dog is not None:
            self.dog.poll()

    def rejoined(self, restart: int, max_restarts: int) -> None:
        self.workers_running = False
        # Another pod's agent acted first; its verdict on a hang is in the round's store (this pod's watchdog
        # published its part): this pod's log says the same, and its next ranks count the hang.
        _say_restart(_hang_of(self.dog), "another pod's agent began a new round", restart, max_restarts)

    def failed(self, failures, restart: int, max_restarts: int, can_restart: bool) -> bool:
        self.workers_running = False
        hung = _hang_of(self.dog)
        if not can_restart or not restartable(failures):
            return False
        _write_failures(failures, RESTARTS_FILE, "a")
        _tell_cause(self.dog, hung, failures, restart)
        _say_restart(hung, describe_failure(failure_records(failures)[0]), restart, max_restarts)
        return True


def _say_restart(hung: HangReport | None, otherwise: str, restart: int, max_restarts: int) -> None:
    """The pod's line for an in-place restart: the gang's hang verdict, else `otherwise`."""
    why = f"the gang hung: {describe_hang(hung)}" if hung else otherwise
    print(f"kubetron.torchrun: {why}: restarting the gang in place from the newest checkpoint (restart {restart} of "
          f"{max_restarts})", file=sys.stderr, flush=True)


def _hang_of(dog: Watchdog | None) -> HangReport | None:
    """The hang that ended this failed round (recorded once in HANGS_FILE and, for the next ranks, in
    KUBETRON_HANGS), or None. A pod whose ranks died of the peers the other pods' agents stopped learns the
    verdict from the round's store too."""
    if dog is None:
        return None
    report = dog.settle()
    if report is not None:
        with contextlib.suppress(OSError):
            with open(os.path.join(dog.dir, HANGS_FILE), "a", encoding="utf-8") as fh:
                fh.write(json.dumps(report) + "\n")
        os.environ[HANGS_ENV] = json.dumps({"hangs": dog.hangs, "lastHang": report})  # the next ranks' (rank 0 reports)
    return report


def _tell_cause(dog: Watchdog | None, hung: HangReport | None, failures, restart: int) -> None:
    """A rank of this pod ended the round by itself (not a peer failure, not SIGTERM, not a hang): the
    RestartCause of the in-place restart `restart`, for rank 0 to report (policy/nodes.py counts them)."""
    own = [f for f in failure_records(failures) if f["exitcode"] != exitcodes.PEER_FAILURE
           and f["signal"] not in ("SIGTERM", "SIGINT")]
    if dog is None or hung is not None or not own:
        return
    how = describe_failure(own[0]).split(") ", 1)[1]  # `was killed by SIGSEGV`
    dog.tell_cause(RestartCause(restart=restart, rank=own[0]["rank"], nodeRank=dog.node_rank, how=how))


SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # seconds torchrun waits for the ranks after a signal


def _watchdog(trainer_args: Sequence[str]) -> Watchdog | None:
    """This pod's hang watchdog, under the launcher (its messages directory holds the ranks' heartbeats);
    None outside it, or with hang detection off (KUBETRON_HANG_TIMEOUT_SECONDS=0)."""
    directory = os.environ.get("KUBETRON_LAUNCH_MESSAGES")
    override = override_from_env(os.environ)
    if not directory or override == 0:
        return None
    attempt = (os.environ.get(JOB_ID_ENV) or "0").rsplit("/", 1)[-1]
    return Watchdog(directory, int(os.environ.get(NODE_RANK_ENV) or 0), override, store_from_args(trainer_args),
                    attempt=attempt)


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from kubetron.compat.torch import elastic
    from kubetron.supervisor import peers

    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    copies = peers.from_env(os.environ, int(str(args.nnodes).rpartition(":")[2]))
    try:  # the agent's internals were read against the torch versions compat names only
        hooks = Recovery(_watchdog(args.training_script_args), copies)
        elastic.install(LocalElasticAgent, hooks, int(os.environ.get(SHUTDOWN_TIMEOUT_ENV) or 30))
        if os.environ.get(NODE_RANK_ENV):
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

            elastic.ranks_follow_node_rank(DynamicRendezvousHandler, int(os.environ[NODE_RANK_ENV]))
    except ConfigError as exc:
        print(f"kubetron.torchrun: {exc}", file=sys.stderr, flush=True)
        return exitcodes.CONFIG_ERROR
    elastic.quiet_failure_report()
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        _write_failures(exc.failures)
        return 1
    except SignalException as exc:  # torchrun has forwarded it and waited for the ranks
        return 128 + int(exc.sigval)
    except RendezvousError as exc:
        # Restarting after a peer failure, the next round cannot form: another pod's agent stopped (its
        # ranks ended in a way no restart cures, and it closed the rendezvous) or the host pod is gone.
        # The ranks' own termination messages say why they ended; this pod ends too, in one line.
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200] or 'another pod stopped'}"
        print(f"kubetron.torchrun: not restarting: no new rendezvous round ({why})", file=sys.stderr, flush=True)
        if hooks.workers_running:  # lost while they trained: torch's agent stopped them (SIGTERM) on its way out
            _write_note(RDZV_LOST_FILE, why)
        else:
            _write_note(RDZV_ROUND_FILE, why)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
