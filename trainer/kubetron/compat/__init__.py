"""Third-party internals behind one seam: what kubetron changes in another library lives here, one module
per library, and nowhere else (tests/test_static_checks.py checks that no other module assigns into one).

Nothing here patches at import. The run's setup installs what is process-wide (`megatron_core.install()`,
before megatron-core is first imported); the rest are named functions the model build calls. Each module
states the versions it was checked against, and its install refuses others (`require_checked`):
a version bump is a re-check of these adaptations, not a surprise at the first step.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kubetron.contract.errors import ConfigError


class UncheckedVersionError(ConfigError):
    """An installed library's version is outside the range a compat module was checked against (the CLI
    prints it as one line, `<library>: <version> is installed; ...`, and exits 2)."""


def installed_version(distribution: str) -> str:
    return metadata.version(distribution)


def require_checked(distribution: str, checked: str) -> None:
    """Refuse, in one line, to adapt `distribution` at a version outside `checked` (a PEP 440 range). A
    pre-release or local build (NGC's `2.11.0a0+git...`) counts as its release."""
    version = installed_version(distribution)
    if Version(Version(version).base_version) not in SpecifierSet(checked):
        raise UncheckedVersionError(distribution, f"{version} is installed; kubetron's adaptations of it were "
                                                  f"checked against {checked} only (kubetron/compat): re-check "
                                                  "them, then widen the range")
