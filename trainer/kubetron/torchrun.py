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

What this changes in torch's elastic agent and rendezvous (the `_`-functions below, installed by `main`,
never at import) was read against the torch versions `kubetron.compat.torch.CHECKED` names; on any other
torch, `main` refuses in one line (exit 2) before adapting anything. (They stay here, beside the recovery
rules they serve, rather than in kubetron/compat: a move left for later, issue 35.)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

from kubetron.compat import require_checked
from kubetron.contract import exitcodes
from kubetron.contract.errors import ConfigError
from kubetron.contract.hang import CAUSE_ENV, HANGS_ENV, HangReport, RestartCause
from kubetron.contract.hang import describe as describe_hang
from kubetron.contract.progress import JOB_ID_ENV
from kubetron.watchdog import Rank, Watchdog, override_from_env, store_from_args

FAILURES_FILE = "torchrun-failures.json"  # in the launcher's messages directory (KUBETRON_LAUNCH_MESSAGES)
NODE_RANK_ENV = "KUBETRON_RDZV_NODE_RANK"  # set by the launcher with a c10d rendezvous: this node's group rank
RESTARTS_FILE = "torchrun-restarts.jsonl"  # ditto: one line per in-place restart of the local workers
HANGS_FILE = "torchrun-hangs.jsonl"  # ditto: one HangReport per hung gang (kubetron.watchdog)


class _NoFailureReport(logging.Filter):
    """Drops torchrun's `failed (exitcode: N) local_rank: ...` line, and its `Sending process N closing
    signal SIGTERM` to the other ranks after one failed (the launcher reports failures)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


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
    directory = os.environ.get("KUBETRON_LAUNCH_MESSAGES")
    if not directory:
        return
    try:
        with open(os.path.join(directory, name), mode, encoding="utf-8") as fh:
            fh.write(json.dumps(failure_records(failures)) + "\n")
    except OSError:
        pass  # the launcher falls back to torchrun's exit status


def restartable(failures) -> bool:
    """Whether the failed local ranks ended in a way an in-place restart can cure.

    Ranks killed by SIGTERM/SIGINT are left out: once one rank fails, torchrun SIGTERMs its siblings
    itself (a preemption's SIGTERM reaches torchrun first, which then stops without restarting).
    """
    def signal_name(f):
        return f.signal_name() if f.exitcode < 0 else None

    causes = [f for f in failures.values() if signal_name(f) not in ("SIGTERM", "SIGINT")]
    return bool(causes) and all(exitcodes.restartable_in_place(f.exitcode, signal_name(f)) for f in causes)


def _only_restart_restartable_ends(agent_class, dog: Watchdog | None = None) -> None:
    """Make torchrun's agent restart a failed worker group only when `restartable`, recording each restart.
    `dog`: the hang watchdog; a gang it stopped is restarted as hung (its report instead of the kill)."""
    monitor = agent_class._monitor_workers

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        hung = _hang_of(dog, result)
        if result.is_failed() and self._remaining_restarts > 0:
            if restartable(result.failures):
                _write_failures(result.failures, RESTARTS_FILE, "a")
                spec = worker_group.spec
                _tell_cause(dog, hung, result.failures, spec.max_restarts - self._remaining_restarts + 1)
                why = f"the gang hung: {describe_hang(hung)}" if hung else describe_failure(
                    failure_records(result.failures)[0])
                print(f"kubetron.torchrun: {why}: restarting "
                      f"the gang in place from the newest checkpoint (restart "
                      f"{spec.max_restarts - self._remaining_restarts + 1} of {spec.max_restarts})",
                      file=sys.stderr, flush=True)
            else:
                self._remaining_restarts = 0  # the group is stopped and the failure reported, as without restarts
        return result

    agent_class._monitor_workers = _monitor_workers
    restart_workers = agent_class._restart_workers

    def _restart_workers(self, worker_group):
        # Healthy workers restarted because a peer node joined a new round: count it as the peer
        # counts its restart. The ranks' store keys are per restart count, so counts that drifted
        # apart would have the new ranks read the previous round's addresses.
        if worker_group.state.name == "HEALTHY":
            self._remaining_restarts -= 1
        # The surviving ranks cannot finish a step with a peer gone, and they resume from the newest
        # checkpoint anyway: SIGKILL them now rather than SIGTERM and wait 30 s for a save that cannot come.
        self._shutdown(death_sig=signal.SIGKILL)
        restart_workers(self, worker_group)

    agent_class._restart_workers = _restart_workers


def _hang_of(dog: Watchdog | None, result) -> HangReport | None:
    """The hang this failed result ends (recorded once in HANGS_FILE and, for the next ranks, in
    KUBETRON_HANGS), or None. A pod whose ranks died of the peers the other pods' agents stopped learns the
    verdict from the round's store too."""
    if dog is None or not result.is_failed():
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


def _watch_for_hangs(agent_class, dog: Watchdog) -> None:
    """Make torchrun's agent run the hang watchdog: every round of workers is handed to it, and its monitor
    loop polls it (kubetron.watchdog stops the ranks of a hung gang; the monitor then sees them fail)."""
    start, monitor = agent_class._start_workers, agent_class._monitor_workers

    def _start_workers(self, worker_group):
        dog.forget_files(w.local_rank for w in worker_group.workers)  # the previous round's
        cause = dog.cause()  # what ended the previous round, when a rank of some pod did
        if cause is not None:
            os.environ[CAUSE_ENV] = json.dumps(cause)  # the new ranks' (rank 0 reports it)
        pids = start(self, worker_group)
        spec = worker_group.spec
        ranks = [Rank(w.global_rank, w.local_rank, pids[w.local_rank]) for w in worker_group.workers]
        dog.new_round(ranks, worker_group.store, worker_group.group_world_size,
                      spec.max_restarts - self._remaining_restarts, self._remaining_restarts)
        return pids

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if not result.is_failed() and result.state.name == "HEALTHY":
            dog.poll()
        return result

    agent_class._start_workers, agent_class._monitor_workers = _start_workers, _monitor_workers
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # seconds torchrun waits for the ranks after a signal


def _shutdown_waits_for_the_ranks(agent_class, grace_s: int) -> None:
    """Make torchrun's agent wait `grace_s` seconds (not 30) for its ranks after forwarding a signal.

    A preempted rank finishes its step and saves before it exits, which can take longer than 30 s. torch
    2.12 reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT and passes it to the agent's `_shutdown(death_sig, timeout)`;
    older torch (2.11 on the GPU machines and NGC images of its age) has `_shutdown(death_sig)`, which
    closes the ranks' process context with its 30 s default and then SIGKILLs them, whatever the variable
    says. There the context's close gets `grace_s`. Checked against torch 2.11.0 (the old signature) and
    2.13.0 (the new one, left alone); tests/test_gpu_layout.py runs a save longer than 30 s under 2.11.
    """
    if "timeout" in inspect.signature(agent_class._shutdown).parameters:
        return  # torch >= 2.12 honours the variable itself
    shutdown = agent_class._shutdown

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM) -> None:
        pcontext = self._pcontext
        if pcontext is not None and death_sig != signal.SIGKILL:
            pcontext.close = functools.partial(type(pcontext).close, pcontext, timeout=grace_s)
        shutdown(self, death_sig)

    agent_class._shutdown = _shutdown


def _ranks_follow_node_rank(handler_class, node_rank: int) -> None:
    """Make each round of torchrun's c10d rendezvous give this node the group rank NODE_RANK, with a
    fresh store for the ranks hosted by global rank 0.

    The rendezvous ranks nodes by host name, but the operator's contract puts global rank 0 (status
    endpoint, progress log) in the pod with NODE_RANK 0. The pods' NODE_RANKs are a permutation of
    0..NNODES-1 and every round has all NNODES nodes (min = max), so the renumbering is consistent.
    The ranks' store address (MASTER_ADDR, a free port of NODE_RANK 0's pod) is published anew in the
    round's own store, so a restarted rank never reads the previous round's keys (with torchrun's
    shared store it would, and connect to a dead peer).
    """
    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # global rank 0 hosts each round's own store
    next_rendezvous = handler_class.next_rendezvous

    def _next_rendezvous(self):
        info = next_rendezvous(self)
        store = PrefixStore("kubetron/", info.store)  # the round's own keys
        ours = RendezvousStoreInfo.build(node_rank, store, local_addr=self._this_node.addr)
        return RendezvousInfo(info.store, node_rank, info.world_size, ours)

    handler_class.next_rendezvous = _next_rendezvous


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

    from kubetron.compat.torch import CHECKED as TORCH_CHECKED

    try:  # the agent's internals below were read against these torch versions only
        require_checked("torch", TORCH_CHECKED)
    except ConfigError as exc:
        print(f"kubetron.torchrun: {exc}", file=sys.stderr, flush=True)
        return exitcodes.CONFIG_ERROR
    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    dog = _watchdog(args.training_script_args)
    if dog is not None:
        _watch_for_hangs(LocalElasticAgent, dog)
    _only_restart_restartable_ends(LocalElasticAgent, dog)
    _shutdown_waits_for_the_ranks(LocalElasticAgent, int(os.environ.get(SHUTDOWN_TIMEOUT_ENV) or 30))
    if os.environ.get(NODE_RANK_ENV):
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

        _ranks_follow_node_rank(DynamicRendezvousHandler, int(os.environ[NODE_RANK_ENV]))
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoFailureReport())
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
        print(f"kubetron.torchrun: not restarting: no new rendezvous round ({type(exc).__name__}: "
              f"{' '.join(str(exc).split())[:200] or 'another pod stopped'})", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
