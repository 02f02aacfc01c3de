"""Shared fixtures and hooks. The S3 server fixture lives in tests/s3server.py (importable by scripts too)."""

from tests.kube.fixtures import kube, kube_ns  # noqa: F401 - the real-API-server fixtures (tests/kube)
from tests.s3server import s3_server  # noqa: F401 - a pytest fixture, re-exported
from tests.typecheck import CHECK, STARTED, Run


def pytest_configure(config):
    """As `kubetron train` does first: megatron-core imported the trainer's way before a test module imports it
    (where it is installed: the operator's tests run without the trainer's extras too)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is not None:
        from kubetron.compat import megatron_core

        megatron_core.install()


def pytest_collection_finish(session):
    """mypy's check (tests/typecheck.py) starts now, beside the tests that run before it."""
    if any(item.nodeid.endswith(CHECK) for item in session.items):
        session.config.stash[STARTED] = Run()


def pytest_sessionfinish(session):
    """A session that ended before the check (-x, ^C) leaves no mypy behind."""
    run = session.config.stash.get(STARTED, None)
    if run is not None and run.proc.poll() is None:
        run.proc.kill()
