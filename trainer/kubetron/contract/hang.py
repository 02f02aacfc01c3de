"""Hangs (docs/recovery.md): the heartbeat each rank publishes, when a rank counts as hung, which rank of a
hung gang is named, and the report that names it.

Each rank's training loop publishes a heartbeat record (kubetron.supervisor.heartbeat writes it into a small shared
file): the iteration it completed last, its phase, when that phase began, when it last made progress (an
iteration, an evaluation batch, a checkpoint file), the slowest of its recent iterations and how many it
completed in this process. The pod's torchrun agent reads the records from outside the training thread
(kubetron.supervisor.watchdog) and judges them by `hang_timeout`:

- `train`: `spec.hangTimeoutSeconds` (KUBETRON_HANG_TIMEOUT_SECONDS), else max(FLOOR_SECONDS,
  STEP_FACTOR x the slowest recent iteration);
- `checkpoint`, `evaluation` and a process's iterations after its first, up to WARMUP_STEPS: ALLOWANCE_FACTOR
  times that, and every file written or batch evaluated is progress;
- `startup` (imports, distributed init, model, checkpoint load, up to the end of the first iteration), `data`
  (the dataset build) and `teardown` are not judged: how long they take depends on the model, the data and the
  store, and nothing in them repeats to measure it by. The collective timeout (dist.distributed_timeout_minutes)
  stays the last resort.

A gang is hung when every rank of it has been idle past its timeout (a rank waiting in a collective for a
slow peer that still makes progress is not), or when all are idle past the iteration's timeout and one of
them is stopped (SIGSTOP, a debugger): it does no legitimately long work, so no phase allowance applies.
The rank named is the first of: a stopped process (it cannot dump its stack), one that did not answer the
stack dump, one whose main thread is not waiting in torch.distributed (stuck in the data loader, the store,
a GPU sync...), then the one idle longest.

Standard library only, no I/O.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

STARTUP, DATA, TRAIN, CHECKPOINT, EVALUATION, TEARDOWN = (
    "startup", "data", "train", "checkpoint", "evaluation", "teardown")
PHASES = (STARTUP, DATA, TRAIN, CHECKPOINT, EVALUATION, TEARDOWN)
"""The phases a rank reports, by index in the heartbeat record."""
UNJUDGED = frozenset({STARTUP, DATA, TEARDOWN})
LONG_PHASES = frozenset({CHECKPOINT, EVALUATION})

FLOOR_SECONDS = 45.0  # the default timeout's floor: detection (plus polling, the dump, the agreement) stays within 60 s
STEP_FACTOR = 5.0  # the default timeout: this many times the slowest recent iteration
ALLOWANCE_FACTOR = 10.0  # checkpoint saves, evaluation and the first iterations: this many times the timeout
WARMUP_STEPS = 3  # iterations of a process that count as its first (compilation, allocator growth, caches)
TIMEOUT_ENV = "KUBETRON_HANG_TIMEOUT_SECONDS"  # spec.hangTimeoutSeconds on every pod (0: hang detection off)
HANGS_ENV = "KUBETRON_HANGS"  # the agent's, for a restarted gang's ranks: {"hangs": n, "lastHang": HangReport}
CAUSE_ENV = "KUBETRON_RESTART_CAUSE"  # the agent's, for a gang restarted after a rank crashed: a RestartCause

# The record: a sequence number at both ends (a reader that sees them differ read a torn record and reads
# again), then iteration, phase index, pid, phase start, last progress, slowest recent step, steps done.
_RECORD = struct.Struct("<QqIIdddqQ")
RECORD_SIZE = _RECORD.size


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat. Times are CLOCK_MONOTONIC seconds (one clock for every process of a machine)."""

    seq: int
    iteration: int  # the last iteration this rank completed (the one it resumed from before its first)
    phase: str
    pid: int
    phase_since: float
    progress_at: float  # the last progress: an iteration, an evaluation batch, a checkpoint file written
    slowest_step: float  # seconds: the slowest of the recent iterations (0 before the first)
    steps: int  # iterations completed by this process

    def idle(self, now: float) -> float:
        """Seconds without progress at `now`."""
        return max(0.0, now - self.progress_at)


def encode_beat(beat: Beat) -> bytes:
    return _RECORD.pack(beat.seq, beat.iteration, PHASES.index(beat.phase), beat.pid, beat.phase_since,
                        beat.progress_at, beat.slowest_step, beat.steps, beat.seq)


def decode_beat(data: bytes) -> Beat | None:
    """The record in `data`, or None when it is short, torn (its two sequence numbers differ) or garbled."""
    if len(data) < RECORD_SIZE:
        return None
    seq, iteration, phase, pid, since, progress_at, slowest, steps, seq2 = _RECORD.unpack_from(data)
    if seq != seq2 or seq == 0 or phase >= len(PHASES) or not all(map(math.isfinite, (since, progress_at, slowest))):
        return None
    return Beat(seq, iteration, PHASES[phase], pid, since, progress_at, slowest, steps)


def parse_timeout(text: str | None) -> float | None:
    """KUBETRON_HANG_TIMEOUT_SECONDS: seconds (> 0), 0 for off (returned as 0.0), unset or garbled: None (default)."""
    try:
        value = float(text) if text not in (None, "") else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def step_timeout(slowest_step: float, override: float | None) -> float:
    """The timeout of a training iteration: the override, else max(FLOOR_SECONDS, STEP_FACTOR x slowest)."""
    if override:
        return override
    return max(FLOOR_SECONDS, STEP_FACTOR * slowest_step)


def hang_timeout(beat: Beat, override: float | None) -> float | None:
    """Seconds without progress after which this rank counts as hung; None: not judged (its phase, or
    hang detection off: override 0)."""
    if override == 0 or beat.phase in UNJUDGED or (beat.phase == TRAIN and beat.steps == 0):
        return None  # start-up ends with the first iteration (compilation, caches): not judged either
    timeout = step_timeout(beat.slowest_step, override)
    if beat.phase in LONG_PHASES or beat.steps < WARMUP_STEPS:
        return ALLOWANCE_FACTOR * timeout
    return timeout


def stalled(beat: Beat, override: float | None, now: float) -> bool:
    """No progress past the rank's hang timeout (its phase's allowance included)."""
    timeout = hang_timeout(beat, override)
    return timeout is not None and beat.idle(now) > timeout


def idle_past_base(beat: Beat, override: float | None, now: float) -> bool:
    """No progress past the training iteration's timeout, in a judged phase: what a stopped rank is judged by
    (it does no legitimately long work: no allowance), and what a pod waits for before it looks closer."""
    if hang_timeout(beat, override) is None:
        return False
    return beat.idle(now) > step_timeout(beat.slowest_step, override)


# -- what a rank was doing: its stack dump (faulthandler's format) ------------------------------------

STOPPED, UNRESPONSIVE, ELSEWHERE, COLLECTIVE = "stopped", "unresponsive", "elsewhere", "collective"
STATES = (STOPPED, UNRESPONSIVE, ELSEWHERE, COLLECTIVE)
"""How a stalled rank was found, in the order a hung gang's rank is named by (the first one found)."""
_WAITING_ON_PEERS = ("/torch/distributed/", "/kubetron/checkpoint/comm.py")


def thread_blocks(dump: str) -> list[list[str]]:
    """A faulthandler dump split into threads, each its frame lines (innermost first)."""
    threads: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Current thread ", "Thread ")):
            threads.append([])
        elif line.startswith("  File ") and threads:
            threads[-1].append(line.strip())
    return threads


def main_thread(dump: str) -> list[str]:
    """The frames of the thread that runs the program (one of its frames is a module's, `<module>`: the
    program's, under runpy's); the last such thread of the dump (a dump appended to a file: the newest)."""
    mains = [frames for frames in thread_blocks(dump) if any(f.endswith(" in <module>") for f in frames)]
    return mains[-1] if mains else []


def classify(dump: str) -> str:
    """COLLECTIVE when the main thread waits in torch.distributed (a collective, the store, a barrier),
    ELSEWHERE when it is anywhere else, UNRESPONSIVE without a dump."""
    frames = main_thread(dump)
    if not frames:
        return UNRESPONSIVE
    return COLLECTIVE if any(part in frames[0] for part in _WAITING_ON_PEERS) else ELSEWHERE


def innermost(dump: str) -> str:
    """Where the main thread is: `file:line in function` of its innermost frame, and, when that is in
    torch, of the innermost one outside it (`distributed_c10d.py:3252 in all_reduce, from grads.py:82 in f`);
    '' without a dump."""
    frames = main_thread(dump)
    if not frames:
        return ""
    where = _frame(frames[0])
    if "/torch/" in frames[0]:
        caller = next((f for f in frames if "/torch/" not in f), None)
        where += f", from {_frame(caller)}" if caller else ""
    return where


def _frame(line: str) -> str:
    """'File "/x/y.py", line 12 in f' -> 'y.py:12 in f'."""
    head, _, func = line.partition(" in ")
    path, _, number = head.removeprefix('File "').partition('", line ')
    return f"{path.rsplit('/', 1)[-1]}:{number} in {func}"


# -- the report ------------------------------------------------------------------------------------


class RankState(TypedDict):
    """One rank without progress past the iteration's timeout, as its pod's agent found it."""

    rank: int  # global
    nodeRank: int  # the pod (NODE_RANK)
    localRank: int
    phase: str
    iteration: int
    idleSeconds: float
    timeoutSeconds: float  # its hang timeout (a stopped rank's: the iteration's, no allowance)
    stalled: bool  # idle past timeoutSeconds
    state: str  # STATES
    where: str  # `innermost` of its dump ('' when it has none)


STATE_BYTES = 64 * 1024  # of one pod's key in the rendezvous store
STATE_RANKS = 1024  # ranks one pod may publish (its local ranks: a node's GPUs)
WHERE_CHARS = 300  # of a rank's `where`


def parse_states(values: Sequence[bytes | str], nnodes: int) -> list[RankState] | None:
    """The ranks the gang's pods published (the rendezvous store's `kubetron/hang/<n>` keys, in node-rank order),
    checked: each key at most STATE_BYTES of a JSON list of at most STATE_RANKS RankStates of its own pod
    (nodeRank n), every field of its type, the phase and state ones this module knows, the numbers finite and
    not negative, `where` cut to WHERE_CHARS. None when any is not: no verdict is drawn from what a peer (or
    anyone who reaches the store, which has no authentication) wrote wrong; the hang is then not judged."""
    out: list[RankState] = []
    for node_rank, value in enumerate(values[:nnodes]):
        if len(value) > STATE_BYTES:
            return None
        try:
            ranks = json.loads(value)
        except ValueError:
            return None
        if not isinstance(ranks, list) or not 0 < len(ranks) <= STATE_RANKS:
            return None
        for data in ranks:
            state = _rank_state(data, node_rank)
            if state is None:
                return None
            out.append(state)
    return out


def _rank_state(data: object, node_rank: int) -> RankState | None:
    types: dict[str, type | tuple[type, ...]] = {
        "rank": int, "nodeRank": int, "localRank": int, "phase": str, "iteration": int, "idleSeconds": (int, float),
        "timeoutSeconds": (int, float), "stalled": bool, "state": str, "where": str}
    if not isinstance(data, dict) or not all(isinstance(data.get(k), t) and (t is bool or not isinstance(
            data.get(k), bool)) for k, t in types.items()):
        return None
    numbers = [data[k] for k in ("rank", "localRank", "iteration", "idleSeconds", "timeoutSeconds")]
    if data["nodeRank"] != node_rank or data["phase"] not in PHASES or data["state"] not in STATES or not all(
            math.isfinite(n) and 0 <= n < 2**63 for n in numbers):
        return None
    return RankState(**{**{k: data[k] for k in types}, "where": data["where"][:WHERE_CHARS]})  # type: ignore[typeddict-item]


def gang_hung(ranks: Sequence[RankState]) -> bool:
    """Every rank of the gang (all idle past the iteration's timeout) is past its own hang timeout, or one is
    stopped: a stopped process makes no progress, whatever its phase allows."""
    return bool(ranks) and (all(r["stalled"] for r in ranks) or any(r["state"] == STOPPED for r in ranks))


class HangReport(TypedDict):
    """A hung gang: the rank named, with where the stacks are. The agents agree on it (kubetron.supervisor.watchdog);
    the status endpoint (`lastHang`), the progress log ("Hang detected"), the termination message (`hang`)
    and the operator's status.lastHang carry it."""

    rank: int
    nodeRank: int
    localRank: int
    phase: str
    iteration: int
    idleSeconds: float
    timeoutSeconds: float
    state: str
    where: str
    ranks: int  # how many ranks were stalled (every rank of the gang)
    stacks: str  # where the stacks are: `<store>/hangs/<id>/` ('' when they could not be written there)
    restart: int  # the in-place restart it caused (1-based), 0 when none was left: the pod ended


def choose(ranks: Sequence[RankState]) -> RankState:
    """The rank to name: the first state of STATES found, then the longest idle, then the lowest rank."""
    return min(ranks, key=lambda r: (STATES.index(r["state"]) if r["state"] in STATES else len(STATES),
                                     -r["idleSeconds"], r["rank"]))


def report(ranks: Sequence[RankState], stacks: str, restart: int) -> HangReport:
    """The report of a gang whose stalled ranks are `ranks` (every rank of it)."""
    hung = choose(ranks)
    return HangReport(rank=hung["rank"], nodeRank=hung["nodeRank"], localRank=hung["localRank"], phase=hung["phase"],
                      iteration=hung["iteration"], idleSeconds=round(hung["idleSeconds"], 1),
                      timeoutSeconds=round(hung["timeoutSeconds"], 1), state=hung["state"], where=hung["where"],
                      ranks=len(ranks), stacks=stacks, restart=restart)


def describe(hang: HangReport) -> str:
    """One line: `rank 1 (pod rank 1) hung: no progress for 47 s in phase train after iteration 35 (stopped:
    it could not dump its stack)`."""
    how = {STOPPED: "stopped: it could not dump its stack", UNRESPONSIVE: "it did not answer the stack dump",
           ELSEWHERE: f"in {hang['where']}", COLLECTIVE: f"waiting in a collective, {hang['where']}"}
    return (f"rank {hang['rank']} (pod rank {hang['nodeRank']}) hung: no progress for {hang['idleSeconds']:.0f} s "
            f"(timeout {hang['timeoutSeconds']:.0f} s) in phase {hang['phase']} after iteration {hang['iteration']} "
            f"({how.get(hang['state'], hang['state'])})")


def parse_report(data: object) -> HangReport | None:
    """A HangReport from the trainer's JSON (the status endpoint, the termination message); None when it
    lacks a key or a value has the wrong type."""
    if not isinstance(data, dict):
        return None
    for key, kind in _REPORT_TYPES.items():
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return None
    return HangReport(**{k: data[k] for k in _REPORT_TYPES})  # type: ignore[typeddict-item]


_REPORT_TYPES: dict[str, type | tuple[type, ...]] = {
    "rank": int, "nodeRank": int, "localRank": int, "phase": str, "iteration": int, "idleSeconds": (int, float),
    "timeoutSeconds": (int, float), "state": str, "where": str, "ranks": int, "stacks": str, "restart": int}


def parse_hangs(text: str | None) -> tuple[int, HangReport | None]:
    """HANGS_ENV: (hangs this attempt, the newest one's report); (0, None) when unset or garbled."""
    try:
        data = json.loads(text) if text else None
    except ValueError:
        return 0, None
    if not isinstance(data, dict) or not isinstance(data.get("hangs"), int):
        return 0, None
    return data["hangs"], parse_report(data.get("lastHang"))


class RestartCause(TypedDict):
    """The rank whose end restarted the gang in place (not a peer failure, not a hang): its pod's agent tells
    the others through the rendezvous store, and rank 0 reports it (`lastRestart`) so the operator can count
    the restarts a node causes (policy/nodes.py)."""

    restart: int  # the in-place restart it caused (1-based)
    rank: int
    nodeRank: int
    how: str  # `was killed by SIGSEGV`, `exited with status 6`


def parse_cause(data: object) -> RestartCause | None:
    """A RestartCause from JSON, or None when a key is missing or of the wrong type."""
    types = {"restart": int, "rank": int, "nodeRank": int, "how": str}
    if not isinstance(data, dict) or not all(isinstance(data.get(k), t) and not isinstance(data.get(k), bool)
                                             for k, t in types.items()):
        return None
    return RestartCause(restart=data["restart"], rank=data["rank"], nodeRank=data["nodeRank"], how=data["how"][:200])
