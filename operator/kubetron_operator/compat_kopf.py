"""Every use of kopf beyond its documented API, in one place: the operator's setup (main.run) installs them
explicitly, and nothing here acts at import.

Read against kopf 1.45.2 (constraints.txt pins it); its patch releases are taken to keep the same internals.
`install` refuses any other kopf with one line naming the installed version and CHECKED, so a kopf whose
internals moved fails at start-up, never by quietly handling jobs otherwise. What is adapted:

- daemons without a finalizer: kopf.daemon always asks for one (to stop the daemon before its object goes),
  which costs a patch and a watch event per new job and makes every deletion wait for the operator. kopf
  offers no argument for this: the handler kopf.daemon registered (in the registry's private `_spawning`
  list) is replaced by a copy with requires_finalizer=False (tests/operator/test_on_kube_events.py sees no
  patch). The daemon must stop by itself when its object goes (handlers: on the job's DELETED event).
- no diff base (NoDiffBase): kopf's record of the last handled spec, and the essence it builds per event.
- quiet watch handlers: kopf logs "Handler '<id>' succeeded." for every event a handler takes; the id is the
  function's name, the text kopf's own.
- watching goes on after an API error: kopf ends a resource's watcher for good when a list or watch request still
  fails after its retries (a 403 or a 5xx for a minute while the API server restarts and its RBAC cache fills) or
  when a stream carries an ERROR event other than 410 Gone. The operator then runs blind: the process and its
  /healthz live on, but no job is reconciled again (kopf#1145, kopf#1276; the chaos soak's CI run saw it after an
  API server restart). `watching.continuous_watch`, which kopf's `infinite_watch` calls again each time it ends,
  is wrapped: such an error ends that one stream with one warning and a pause (KEEP_WATCHING, doubling while it
  fails, reset by any event), then kopf lists and watches anew.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import kopf
from kubetron.contract.errors import ConfigError

CHECKED = ((1, 45, 2), (1, 46))
"""The kopf versions these adaptations were checked against: at least the first, below the second."""
CHECKED_TEXT = ">={},<{}".format(*(".".join(map(str, bound)) for bound in CHECKED))  # for the refusal
KEEP_WATCHING = (1.0, 30.0)  # seconds before a failed watch of a resource lists again: the first, doubling to the cap

log = logging.getLogger("kubetron.operator")


def installed_version() -> str:
    """The version of the kopf distribution installed."""
    return importlib.metadata.version("kopf")


def checked(version: str) -> bool:
    """Whether `version` lies in CHECKED, by its leading release numbers ("1.45.2.post1" is 1.45.2)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    release = tuple(int(n) for n in match.group().split(".")) if match else ()
    low, below = CHECKED
    return low <= release < below


def install(registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings, *,
            daemons: Iterable[Callable[..., Any]] = (), quiet: Iterable[Callable[..., Any]] = ()) -> None:
    """Check the installed kopf (ConfigError, one line, outside CHECKED), then adapt it: the registered
    `daemons` ask for no finalizer, `settings` keep no diff base, and the watch handlers `quiet` log no
    line per event they handle."""
    version = installed_version()
    if not checked(version):
        raise ConfigError("kopf", f"version {version} is installed; kubetron_operator.compat_kopf was checked "
                          f"against kopf{CHECKED_TEXT} only (constraints.txt pins the one CI runs)")
    for fn in daemons:
        _needs_no_finalizer(registry, fn)
    settings.persistence.diffbase_storage = NoDiffBase()
    lines = tuple(f"Handler '{fn.__name__}'" for fn in quiet)
    if lines:
        logging.getLogger("kopf.objects").addFilter(functools.partial(_not_success, lines))
    keep_watching()


def keep_watching() -> None:
    """Wrap kopf's `continuous_watch` so an API error ends only the stream it broke (see the module docstring).
    Once per process: a second call finds it wrapped."""
    from kopf._cogs.clients import errors, watching

    inner = watching.continuous_watch
    if getattr(inner, "kubetron_keeps_watching", False):
        return
    failing: dict[tuple[str, str | None], int] = {}  # (resource, namespace) -> streams that failed in a row

    async def continuous_watch(**kwargs: Any) -> AsyncIterator[Any]:
        key = (str(kwargs.get("resource")), kwargs.get("namespace"))
        try:
            async for event in inner(**kwargs):
                failing.pop(key, None)
                yield event
        except (errors.APIError, watching.WatchingError) as exc:
            failed = failing[key] = failing.get(key, 0) + 1
            delay = min(KEEP_WATCHING[1], KEEP_WATCHING[0] * 2 ** (failed - 1))
            where = f" in namespace {key[1]}" if key[1] else ""
            log.warning("watching %s%s failed (%s); listing again in %.0fs", key[0], where, _why(exc), delay)
            await asyncio.sleep(delay)

    continuous_watch.kubetron_keeps_watching = True  # type: ignore[attr-defined]
    watching.continuous_watch = continuous_watch


def _why(exc: Exception) -> str:
    """One short line for an API error: its HTTP status and the server's message."""
    status = getattr(exc, "status", None)
    text = getattr(exc, "message", None) or (exc.args[0] if exc.args else "") or type(exc).__name__
    line = " ".join(str(text).split())[:200]
    return f"HTTP {status}: {line}" if status else line


def _not_success(lines: tuple[str, ...], record: logging.LogRecord) -> bool:
    """Drop kopf's "Handler '<id>' succeeded." lines of the quiet handlers: one per watch event."""
    return not (record.levelno <= logging.INFO and record.getMessage().startswith(lines))


def _needs_no_finalizer(registry: kopf.OperatorRegistry, fn: Callable[..., Any]) -> None:
    """Replace the daemon handler of `fn` by a copy with requires_finalizer=False (see the module docstring)."""
    spawning = registry._spawning._handlers
    matching = [i for i, h in enumerate(spawning) if h.fn is fn]
    if len(matching) != 1:
        raise RuntimeError(f"kopf registered {len(matching)} daemons for {fn.__name__}, not one")
    spawning[matching[0]] = dataclasses.replace(spawning[matching[0]], requires_finalizer=False)


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's record of the spec it last handled, kept for change handlers' diffs (on.create/update),
    would cost an annotation patch on every new or edited job; the one change handler here is on.delete,
    which needs no diff. With none stored, every change of a live job is a "creation" without handlers.
    Nor is the essence built (a deep copy of every watched job and pod, for those diffs and for daemons'
    idle timeouts, unused here)."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None
