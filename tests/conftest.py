"""Shared fixtures. The S3 server fixture lives in tests/s3server.py (importable by scripts too)."""

from tests.kube.fixtures import kube, kube_ns  # noqa: F401 - the real-API-server fixtures (tests/kube)
from tests.s3server import s3_server  # noqa: F401 - a pytest fixture, re-exported


def pytest_configure(config):
    """As `kubetron train` does first: megatron-core imported the trainer's way before a test module imports it
    (where it is installed: the operator's tests run without the trainer's extras too)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is not None:
        from kubetron.compat import megatron_core

        megatron_core.install()
