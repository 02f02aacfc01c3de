"""Shared fixtures and hooks. The S3 server fixture lives in tests/s3server.py (importable by scripts too)."""

import re

import pytest
from kubetron.supervisor.watchdog import HANGS_DIR  # where a pod's watchdog puts a hung gang's stacks

from tests.kube.fixtures import kube, kube_ns  # noqa: F401 - the real-API-server fixtures (tests/kube)
from tests.s3server import s3_server  # noqa: F401 - a pytest fixture, re-exported
from tests.typecheck import CHECK, STARTED, Run

TIERS = ("unit", "trainer", "process", "cluster")
"""The suite's tiers, cheapest first (pyproject.toml's markers say what each holds). Every test module sets its
tier (`pytestmark`); a test that costs more than its module's tier carries its own mark, and its own wins."""


def tier_of(item) -> str | None:
    """The tier mark closest to the test (its own, then its class's, then its module's)."""
    return next((mark.name for mark in item.iter_markers() if mark.name in TIERS), None)


def pytest_addoption(parser):
    parser.addoption("--tier", action="append", choices=TIERS, default=None,
                     help="run only the tests of this tier (repeatable); `make test-fast` is --tier unit")


def pytest_collection_modifyitems(config, items):
    """--tier: keep the tests whose closest tier mark is one of those asked for."""
    wanted = config.getoption("--tier")
    if not wanted:
        return
    keep = [item for item in items if tier_of(item) in wanted]
    kept = {id(item) for item in keep}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep


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


@pytest.fixture(scope="session", autouse=True)
def no_hang_but_on_purpose(request, tmp_path_factory):
    """After the session: no watchdog reported a hang (its stacks in a store under the session's temporary
    directory, local stores and the S3 server's alike) but in the tests marked hangs_on_purpose. A slow
    store, a long save or a loaded machine must never look like a hang."""
    yield
    on_purpose = {re.sub(r"\W", "_", item.name)[:30] for item in request.session.items
                  if item.get_closest_marker("hangs_on_purpose")}
    base = tmp_path_factory.getbasetemp()
    reported = [p.relative_to(base) for p in base.rglob(HANGS_DIR) if p.is_dir() and any(p.iterdir())]
    unexpected = [str(p) for p in reported if not any(p.parts[0].startswith(name) for name in on_purpose)]
    assert not unexpected, f"hangs reported outside the tests that hang on purpose: {unexpected}"
