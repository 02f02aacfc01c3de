"""The hang watchdog of one pod (docs/recovery.md): its torchrun agent (kubetron.torchrun) calls `poll()` from
the loop that monitors its ranks, and stops them once the gang hung.

Each poll (every POLL_SECONDS) reads the local ranks' heartbeats (kubetron.heartbeat, judged by
kubetron.contract.hang). Once every local rank is stalled, their stacks are dumped (DUMP_SIGNAL: faulthandler
in each rank; a stopped process cannot answer, which /proc says) and this pod's stalled ranks are published in
the rendezvous round's store (`kubetron/hang/<node rank>`; withdrawn if a rank moves again). Once every pod of
the round has published, the gang is hung: every agent reads the same reports and names the same rank
(contract.hang.choose), writes its ranks' stacks into the job's store (`hangs/<attempt>-<restart>/rank-<r>.txt`,
the named pod also `report.json`), prints a summary in the pod's log and SIGKILLs its ranks. torchrun then
restarts the gang in place from the newest checkpoint (a kill is restartable), or, with no restart left,
the pod ends with exit code 7 (Hung; kubetron.launch).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kubetron.contract import hang
from kubetron.contract.hang import HangReport, RankState

POLL_SECONDS = 1.0
DUMP_WAIT = 3.0  # seconds the ranks get to write their stacks
UPLOAD_WAIT = 20.0  # seconds the stacks' upload may take before the agent goes on without it
STACK_LINES = 12  # frames of each rank's main thread in the pod's log
STACK_BYTES = 256 * 1024  # of a rank's dump kept (its newest part)
HANGS_DIR = "hangs"  # in the job's store
KEY = "kubetron/hang/"  # + node rank, in the round's rendezvous store
CAUSE_KEY = "kubetron/restart-cause"  # in the round's rendezvous store: the RestartCause that ended it
VERDICT_KEY = "kubetron/hang-verdict"  # in the round's store: the pods' keys the first agent to act judged by
STOPPED_STATES = ("T", "t")  # /proc/<pid>/stat: stopped by a signal, stopped by a tracer


def heartbeat_path(messages_dir: str, local_rank: int | str) -> str:
    return os.path.join(messages_dir, f"heartbeat-{local_rank}")


def stacks_path(messages_dir: str, local_rank: int | str) -> str:
    return os.path.join(messages_dir, f"stacks-{local_rank}.txt")


@dataclass(frozen=True)
class Rank:
    """One local rank of the current round: its global and local rank and its process."""

    rank: int
    local_rank: int
    pid: int


def process_state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped, t: traced; '' when gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def read_beat(path: str) -> hang.Beat | None:
    """A rank's heartbeat (None before it wrote one); a torn read is read again."""
    for _ in range(3):
        try:
            with open(path, "rb") as fh:
                beat = hang.decode_beat(fh.read(hang.RECORD_SIZE))
        except OSError:
            return None
        if beat is not None:
            return beat
    return None


def read_tail(path: str, start: int) -> str:
    """What was appended to `path` since byte `start` (at most STACK_BYTES, the newest)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(start, os.path.getsize(path) - STACK_BYTES))
            return fh.read(STACK_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class Watchdog:
    """The hang watchdog of this pod's ranks (see the module docstring). `store_url`: the job's store, where
    the stacks go (None: the pod's log only); `attempt`: the attempt's number, for their folder."""

    def __init__(self, messages_dir: str, node_rank: int, override: float | None, store_url: str | None = None,
                 attempt: str = "0", clock: Callable[[], float] = time.monotonic):
        self.dir, self.node_rank, self.override = messages_dir, node_rank, override
        self.store_url, self.attempt, self.clock = store_url, attempt, clock
        self.ranks: list[Rank] = []
        self.store: Any = None
        self.nnodes, self.restart, self.restarts_left = 1, 0, 0
        self.hangs = 0  # gangs this agent saw hang, this attempt
        self.report: HangReport | None = None  # the current round's, once the gang hung
        self._reset()
        self._withdrawn: dict[int, str] = {}  # the dumps of the part this pod published, then withdrew

    def _reset(self) -> None:
        self.state, self.report = "watch", None
        self._next = 0.0
        self._dumped_at = 0.0
        self._sizes: dict[int, int] = {}
        self._dumps: dict[int, str] = {}

    @property
    def enabled(self) -> bool:
        return self.override != 0

    def new_round(self, ranks: Sequence[Rank], store: Any, nnodes: int, restart: int, restarts_left: int) -> None:
        """The agent started a round of workers: `ranks` here, `store` the round's, the `restart`-th in place."""
        self.ranks, self.store, self.nnodes = list(ranks), store, nnodes
        self.restart, self.restarts_left = restart, restarts_left
        self._reset()
        self._withdrawn = {}

    def tell_cause(self, cause: hang.RestartCause) -> None:
        """This pod's rank ended the round (a crash, not a hang): say so in the round's store, for rank 0."""
        with contextlib.suppress(Exception):  # best effort: the restart goes on without it
            self.store.set(CAUSE_KEY, json.dumps(cause))

    def cause(self) -> hang.RestartCause | None:
        """What ended the current (old) round, as a pod's agent said (read before the next round starts)."""
        try:
            if self.store is None or not self.store.check([CAUSE_KEY]):
                return None
            return hang.parse_cause(json.loads(self.store.get(CAUSE_KEY)))
        except Exception:  # noqa: BLE001 - the round's store may be gone with its host
            return None

    def forget_files(self, local_ranks: Iterable[int]) -> None:
        """Before a round starts: the previous ranks' heartbeats and stacks go (never read as the new ones')."""
        for local_rank in local_ranks:
            for path in (heartbeat_path(self.dir, local_rank), stacks_path(self.dir, local_rank)):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def poll(self) -> HangReport | None:
        """Look at the ranks (at most every POLL_SECONDS); the report once the gang hung (the ranks were killed)."""
        now = self.clock()
        if not self.enabled or not self.ranks or self.state == "acted" or now < self._next:
            return None
        self._next = now + POLL_SECONDS
        beats = {r.local_rank: read_beat(heartbeat_path(self.dir, r.local_rank)) for r in self.ranks}
        if not all(b is not None and b.pid == r.pid and hang.idle_past_base(b, self.override, now)
                   for r, b in zip(self.ranks, beats.values(), strict=True)):
            if self.state == "published":
                self._withdraw()
                self._withdrawn = self._dumps  # for the verdict another pod may still reach on what it published
            if self.state != "watch":
                self._reset()
            return None
        if self.state == "watch":
            self._dump(now)
            self._next = now + 0.1  # the dumps take milliseconds
        elif self.state == "dumping" and self._dumped(now):
            self._publish(beats, now)  # type: ignore[arg-type]  # all present: checked above
        elif self.state == "published":
            self._publish(beats, now)  # type: ignore[arg-type]  # idle and stalled as of now
            return self._agree()
        return None

    # -- the steps ------------------------------------------------------------------------------------

    def _dump(self, now: float) -> None:
        """Ask every local rank for its stacks (a stopped one answers only once continued)."""
        self.state, self._dumped_at = "dumping", now
        for r in self.ranks:
            path = stacks_path(self.dir, r.local_rank)
            self._sizes[r.local_rank] = _size(path)
            try:
                os.kill(r.pid, signal.SIGUSR1)
            except OSError:
                pass

    def _dumped(self, now: float) -> bool:
        """Every rank's dump is in (its file grew) or it is stopped (it cannot answer), or DUMP_WAIT passed."""
        answered = all(_size(stacks_path(self.dir, r.local_rank)) > self._sizes[r.local_rank]
                       or process_state(r.pid) in STOPPED_STATES for r in self.ranks)
        return answered or now - self._dumped_at > DUMP_WAIT

    def _publish(self, beats: dict[int, hang.Beat], now: float) -> None:
        """This pod's idle ranks, each with what its dump (or /proc) says and whether it is past its own hang
        timeout, into the round's store (again at each poll: the time goes on)."""
        states = []
        for r in self.ranks:
            if r.local_rank not in self._dumps:
                self._dumps[r.local_rank] = read_tail(stacks_path(self.dir, r.local_rank), self._sizes[r.local_rank])
            dump, beat = self._dumps[r.local_rank], beats[r.local_rank]
            stopped = process_state(r.pid) in STOPPED_STATES
            timeout = hang.step_timeout(beat.slowest_step, self.override) if stopped else hang.hang_timeout(
                beat, self.override) or 0.0
            states.append(RankState(rank=r.rank, nodeRank=self.node_rank, localRank=r.local_rank, phase=beat.phase,
                                    iteration=beat.iteration, idleSeconds=round(beat.idle(now), 1),
                                    timeoutSeconds=timeout, stalled=beat.idle(now) > timeout,
                                    state=hang.STOPPED if stopped else hang.classify(dump), where=hang.innermost(dump)))
        self.store.set(f"{KEY}{self.node_rank}", json.dumps(states))
        self.state = "published"

    def _withdraw(self) -> None:
        try:
            self.store.delete_key(f"{KEY}{self.node_rank}")
        except Exception:  # noqa: BLE001 - the store is the rendezvous'; a failed delete only delays nothing
            pass

    def settle(self) -> HangReport | None:
        """The ranks failed: the report when the gang hung (also when another pod's agent stopped it first and
        this pod's ranks died of that before the verdict was read here, or after this pod withdrew its part: its
        ranks, ending of their peer's death, moved again), else None."""
        with contextlib.suppress(Exception):  # the round's store may be gone with its host
            if self.state == "published" and (report := self._agree(kill=False)) is not None:
                return report
            if self.state != "acted" and self.store is not None and self.store.check([VERDICT_KEY]):
                raw = self.store.get(VERDICT_KEY)  # another agent's copy of the keys it judged by: checked
                values = json.loads(raw) if len(raw) <= hang.STATE_BYTES * self.nnodes * 2 else None
                if isinstance(values, list) and len(values) == self.nnodes and all(isinstance(v, str) for v in values):
                    self._dumps = self._dumps or self._withdrawn
                    return self._agree(kill=False, values=values)
        return self.report

    def _agree(self, kill: bool = True, values: Sequence[bytes | str] | None = None) -> HangReport | None:
        """Once every pod published: the report (the same on every pod), this pod's part done, its ranks killed.
        `values`: the pods' keys as another agent judged them (VERDICT_KEY), instead of the store's now."""
        if values is None:
            keys = [f"{KEY}{n}" for n in range(self.nnodes)]
            if not self.store.check(keys):
                return None
            values = self.store.multi_get(keys)
        ranks = hang.parse_states(values, self.nnodes)  # peers' keys: checked, bounded
        if ranks is None or not hang.gang_hung(ranks):
            return None  # all idle, not all past their phase's allowance yet (a slow save, a long evaluation)
        if kill:  # for the pods that withdraw their part before they read the verdict (their ranks end meanwhile)
            with contextlib.suppress(Exception):
                self.store.set(VERDICT_KEY, json.dumps([v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                                                        for v in values]))
        folder = f"{HANGS_DIR}/{self.attempt}-{self.restart + 1}"
        location = f"{self.store_url.rstrip('/')}/{folder}/" if self.store_url else ""
        report = hang.report(ranks, location, self.restart + 1 if self.restarts_left > 0 else 0)
        self.state, self.report, self.hangs = "acted", report, self.hangs + 1
        self._summarize(report, ranks)
        for r in self.ranks if kill else ():  # a SIGKILL reaches a stopped process too
            try:
                os.kill(r.pid, signal.SIGKILL)
            except OSError:
                pass
        self._upload(folder, report)
        return report

    def _summarize(self, report: HangReport, ranks: list[RankState]) -> None:
        """The pod's log: the verdict, then each local rank (the hung one first) with its innermost frames."""
        where = f"; stacks in {report['stacks']}" if report["stacks"] else ""
        out = [f"kubetron.watchdog: the gang hung ({report['ranks']} ranks without progress): "
               f"{hang.describe(report)}{where}"]
        mine = sorted((s for s in ranks if s["nodeRank"] == self.node_rank), key=lambda s: s["rank"] != report["rank"])
        for s in mine:
            out.append(f"kubetron.watchdog: rank {s['rank']}: {s['state']}, idle {s['idleSeconds']:.0f} s in phase "
                       f"{s['phase']} after iteration {s['iteration']}")
            out += [f"    {line}" for line in hang.main_thread(self._dumps.get(s["localRank"], ""))[:STACK_LINES]]
        print("\n".join(out), file=sys.stderr, flush=True)

    def _upload(self, folder: str, report: HangReport) -> None:
        """This pod's stacks (and, from the named rank's pod, the report) into the job's store, in a thread
        bounded by UPLOAD_WAIT: a wedged store (maybe the hang's cause) must not hold the restart."""
        if not self.store_url:
            return
        files = {f"{folder}/rank-{r.rank}.txt": self._dumps.get(r.local_rank, "").encode() or
                 b"(no stack: the process did not answer the dump)\n" for r in self.ranks}
        if report["nodeRank"] == self.node_rank:
            files[f"{folder}/report.json"] = json.dumps(report, indent=1).encode()
        thread = threading.Thread(target=self._write, args=(files,), name="kubetron-hang-upload", daemon=True)
        thread.start()
        thread.join(UPLOAD_WAIT)

    def _write(self, files: dict[str, bytes]) -> None:
        try:
            from kubetron.storage import open_store

            store = open_store(self.store_url)  # type: ignore[arg-type]  # checked by _upload
            for key, data in files.items():
                store.write_bytes(key, data)
        except Exception as exc:  # noqa: BLE001 - the log has the summary; say why the store has not
            print(f"kubetron.watchdog: cannot write the stacks to {self.store_url}: {exc}", file=sys.stderr, flush=True)


def store_from_args(args: Sequence[str]) -> str | None:
    """The job's store: the trainer's `checkpoint.save=` override (the operator always sets it)."""
    found = [a.split("=", 1)[1] for a in args if a.startswith("checkpoint.save=")]
    return found[-1] if found and found[-1] else None


def override_from_env(env: dict[str, str] | os._Environ[str]) -> float | None:
    return hang.parse_timeout(env.get(hang.TIMEOUT_ENV))

