"""kopf's internals are used in one module (kubetron_operator.compat_kopf), checked against a range of kopf
versions: the installed kopf must be in it (else this test fails first, loudly), any other is refused at
install with one line, and what install adapts is what the operator relies on (no finalizer on a job's
daemon, no diff base, no log line per watch event)."""

from __future__ import annotations

import logging

import kopf
import pytest
from kubetron.contract.errors import ConfigError
from kubetron_operator import compat_kopf, handlers

pytestmark = pytest.mark.unit


@pytest.fixture
def kopf_log():
    """kopf's per-object logger, its filters as they were once the test is over."""
    logger = logging.getLogger("kopf.objects")
    before = list(logger.filters)
    yield logger
    logger.filters[:] = before


def daemons(registry: kopf.OperatorRegistry) -> list:
    # The same kopf internal compat_kopf edits: if kopf moves it, this test says so along with install.
    return [h for h in registry._spawning._handlers if h.fn is handlers.reconcile_daemon]


def test_the_installed_kopf_is_in_the_range_compat_kopf_was_checked_against():
    version = compat_kopf.installed_version()
    assert compat_kopf.checked(version), (
        f"kopf {version} is installed, but kubetron_operator.compat_kopf was checked against kopf"
        f"{compat_kopf.CHECKED_TEXT} only: read its adaptations against kopf {version}, then widen CHECKED")


@pytest.mark.parametrize(("version", "checked"), [
    ("1.45.2", True), ("1.45.3", True), ("1.45.2.post1", True),
    ("1.45.1", False), ("1.44.9", False), ("1.46.0", False), ("1.46.0rc1", False), ("2.0", False), ("dev", False),
])
def test_the_checked_range(version, checked):
    assert compat_kopf.checked(version) is checked


@pytest.mark.parametrize("version", ["1.44.0", "1.46.0", "2.1.0"])
def test_an_unchecked_kopf_is_refused_with_one_line_naming_it_and_the_range(monkeypatch, kopf_log, version):
    monkeypatch.setattr(compat_kopf, "installed_version", lambda: version)
    registry, settings = handlers.register(kopf.OperatorRegistry()), kopf.OperatorSettings()
    with pytest.raises(ConfigError) as refused:
        compat_kopf.install(registry, settings, daemons=[handlers.reconcile_daemon], quiet=[handlers.job_event])
    message = str(refused.value)
    assert "\n" not in message and message.startswith("kopf: ")
    assert f"version {version} is installed" in message and compat_kopf.CHECKED_TEXT in message
    # nothing was adapted
    assert [h.requires_finalizer for h in daemons(registry)] == [True]
    assert not isinstance(settings.persistence.diffbase_storage, compat_kopf.NoDiffBase)
    assert kopf_log.filters == []


def test_install_drops_the_daemons_finalizer_and_the_diff_base_and_quiets_the_watch_handler(kopf_log):
    registry, settings = handlers.register(kopf.OperatorRegistry()), kopf.OperatorSettings()
    assert [h.requires_finalizer for h in daemons(registry)] == [True]  # what kopf.daemon asks for
    compat_kopf.install(registry, settings, daemons=[handlers.reconcile_daemon], quiet=[handlers.job_event])
    assert [h.requires_finalizer for h in daemons(registry)] == [False]
    assert isinstance(settings.persistence.diffbase_storage, compat_kopf.NoDiffBase)

    def record(message: str, level: int = logging.INFO) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, message, (), None)

    assert not kopf_log.filter(record("Handler 'job_event' succeeded."))
    assert kopf_log.filter(record("Handler 'job_event' failed with an exception. Will retry.", logging.ERROR))
    assert kopf_log.filter(record("Handler 'cleanup_on_delete' succeeded."))


def test_a_daemon_kopf_did_not_register_is_an_error():
    with pytest.raises(RuntimeError, match="registered 0 daemons for reconcile_daemon"):
        compat_kopf.install(kopf.OperatorRegistry(), kopf.OperatorSettings(), daemons=[handlers.reconcile_daemon])


def test_a_watch_an_api_error_broke_is_listed_again_not_ended_for_good(monkeypatch, caplog):
    """kopf's own infinite_watch, over a stream that fails twice (a 403 the API server answered while its RBAC
    cache filled after a restart; an ERROR event other than 410): unadapted, the first error ends the watcher
    for good and the operator runs blind (kopf#1145). Adapted, each ends only its stream, with one warning and a
    pause, and the third stream's event arrives."""
    import asyncio

    from kopf._cogs.clients import errors, watching
    from kopf._cogs.structs.references import Resource

    streams = []

    async def stream(**kwargs):
        streams.append(kwargs["namespace"])
        if len(streams) == 1:
            raise errors.APIForbiddenError({"message": "trainingjobs is forbidden: RBAC: role not found"},
                                           status=403, headers={})
        if len(streams) == 2:
            raise watching.WatchingError("Error in the watch-stream: {'code': 504, 'message': 'Too large'}")
        yield {"type": "ADDED", "object": {"metadata": {"name": "gpt"}}}

    monkeypatch.setattr(watching, "continuous_watch", stream)
    monkeypatch.setattr(compat_kopf, "KEEP_WATCHING", (0.01, 0.02))
    compat_kopf.keep_watching()
    compat_kopf.keep_watching()  # once: a second call wraps nothing more (else two lines per error)

    async def watch():
        resource = Resource(group="kubetron.dev", version="v1alpha1", plural="trainingjobs", namespaced=True)
        return [e async for e in watching.infinite_watch(settings=kopf.OperatorSettings(), resource=resource,
                                                         namespace="team-a", _iterations=3)]
    with caplog.at_level(logging.WARNING, logger="kubetron.operator"):
        events = asyncio.run(watch())
    assert events == [{"type": "ADDED", "object": {"metadata": {"name": "gpt"}}}] and streams == ["team-a"] * 3
    lines = [r.getMessage() for r in caplog.records if r.name == "kubetron.operator"]
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines
    assert lines[0].startswith("watching trainingjobs.v1alpha1.kubetron.dev in namespace team-a failed (HTTP 403: "
                               "trainingjobs is forbidden: RBAC: role not found); listing again in"), lines
    assert "504" in lines[1]
