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
