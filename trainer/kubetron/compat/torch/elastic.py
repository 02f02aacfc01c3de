"""torch's elastic agent and rendezvous (what `torchrun` runs), adapted to kubetron's recovery rules.

torch offers no hooks into its agent's rounds, so these replace private methods of
`LocalElasticAgent` (`_start_workers`, `_monitor_workers`, `_restart_workers`, `_shutdown`) and
`DynamicRendezvousHandler.next_rendezvous`, each wrapping torch's own. They were read against the
versions `CHECKED` names (torch's, `kubetron.compat.torch`); `install` refuses any other.

The rules themselves are kubetron's and stay in `kubetron.supervisor.torchrun`, handed in as `AgentHooks`: which
failures are restarted in place, what a restart records, the hang watchdog's rounds. This module knows
only where torch's agent starts, watches, restarts and stops its workers.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Protocol

from kubetron.compat import require_checked
from kubetron.compat.torch import CHECKED


@dataclass(frozen=True)
class Worker:
    """One local rank as the agent started it."""

    global_rank: int
    local_rank: int
    pid: int


@dataclass(frozen=True)
class Round:
    """One round of the agent's workers, just started."""

    workers: list[Worker]
    store: Any  # the round's torch.distributed Store
    group_world_size: int  # nodes in the round
    restarts_done: int
    restarts_left: int


class AgentHooks(Protocol):
    """What kubetron does at each point of the agent's rounds."""

    def before_start(self, local_ranks: list[int]) -> None:
        """A round's workers are about to start."""

    def started(self, round_: Round) -> None:
        """A round's workers have started."""

    def healthy(self) -> None:
        """One tick of the agent's monitor loop with every worker running."""

    def rejoined(self, restart: int, max_restarts: int) -> None:
        """This pod's workers, healthy, are restarted because another pod's agent began a new round (its ranks
        failed, or the pods' watchdogs stopped a hung gang and that agent acted first): restart `restart`."""

    def failed(self, failures: dict[int, Any], restart: int, max_restarts: int, can_restart: bool) -> bool:
        """The round failed (`failures`: torch's {global rank: ProcessFailure}). `restart`: the number the
        in-place restart would have (1-based); `can_restart`: torch has restarts left. Returns whether to
        restart in place; False stops the agent as if it had none left (the failure reported, as without
        restarts)."""
        ...


def install(agent_class: Any, hooks: AgentHooks, shutdown_grace_s: int) -> None:
    """Adapt torchrun's `LocalElasticAgent` (the class, before torchrun builds its agent) to `hooks`, and
    make it wait `shutdown_grace_s` for its ranks after forwarding a signal."""
    require_checked("torch", CHECKED)
    _hook_rounds(agent_class, hooks)
    _restart_kills_the_survivors(agent_class, hooks)
    _shutdown_waits_for_the_ranks(agent_class, shutdown_grace_s)


def _hook_rounds(agent_class: Any, hooks: AgentHooks) -> None:
    start, monitor = agent_class._start_workers, agent_class._monitor_workers

    def _start_workers(self, worker_group):
        hooks.before_start([w.local_rank for w in worker_group.workers])
        pids = start(self, worker_group)
        spec = worker_group.spec
        workers = [Worker(w.global_rank, w.local_rank, pids[w.local_rank]) for w in worker_group.workers]
        hooks.started(Round(workers, worker_group.store, worker_group.group_world_size,
                            spec.max_restarts - self._remaining_restarts, self._remaining_restarts))
        return pids

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.is_failed():
            spec = worker_group.spec
            can_restart = self._remaining_restarts > 0
            restart = hooks.failed(result.failures, spec.max_restarts - self._remaining_restarts + 1,
                                   spec.max_restarts, can_restart)
            if can_restart and not restart:
                self._remaining_restarts = 0  # the group is stopped and the failure reported, as without restarts
        elif result.state.name == "HEALTHY":
            hooks.healthy()
        return result

    agent_class._start_workers, agent_class._monitor_workers = _start_workers, _monitor_workers


def _restart_kills_the_survivors(agent_class: Any, hooks: AgentHooks) -> None:
    restart_workers = agent_class._restart_workers

    def _restart_workers(self, worker_group):
        # Healthy workers restarted because a peer node joined a new round: count it as the peer
        # counts its restart. The ranks' store keys are per restart count, so counts that drifted
        # apart would have the new ranks read the previous round's addresses.
        if worker_group.state.name == "HEALTHY":
            self._remaining_restarts -= 1
            hooks.rejoined(worker_group.spec.max_restarts - self._remaining_restarts, worker_group.spec.max_restarts)
        # The surviving ranks cannot finish a step with a peer gone, and they resume from the newest
        # checkpoint anyway: SIGKILL them now rather than SIGTERM and wait 30 s for a save that cannot come.
        self._shutdown(death_sig=signal.SIGKILL)
        restart_workers(self, worker_group)

    agent_class._restart_workers = _restart_workers


def _shutdown_waits_for_the_ranks(agent_class: Any, grace_s: int) -> None:
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


def ranks_follow_node_rank(handler_class: Any, node_rank: int) -> None:
    """Make each round of torchrun's c10d rendezvous (`DynamicRendezvousHandler`) give this node the group
    rank `node_rank`, with a fresh store for the ranks hosted by global rank 0.

    The rendezvous ranks nodes by host name, but the operator's contract puts global rank 0 (status
    endpoint, progress log) in the pod with NODE_RANK 0. The pods' NODE_RANKs are a permutation of
    0..NNODES-1 and every round has all NNODES nodes (min = max), so the renumbering is consistent.
    The ranks' store address (MASTER_ADDR, a free port of NODE_RANK 0's pod) is published anew in the
    round's own store, so a restarted rank never reads the previous round's keys (with torchrun's
    shared store it would, and connect to a dead peer).
    """
    require_checked("torch", CHECKED)
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


class _NoFailureReport(logging.Filter):
    """Drops torchrun's `failed (exitcode: N) local_rank: ...` line, and its `Sending process N closing
    signal SIGTERM` to the other ranks after one failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


def quiet_failure_report() -> None:
    """torchrun logs no line per failed rank (kubetron's launcher reports failures, in one line)."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoFailureReport())
