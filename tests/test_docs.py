"""Docs that are generated must not drift from the code they describe."""

from pathlib import Path

import pytest
from kubetron.contract.config import config_reference_markdown

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


def test_config_reference_is_current():
    committed = (REPO / "docs" / "config-reference.md").read_text()
    assert committed.strip() == config_reference_markdown().strip(), (
        "docs/config-reference.md is stale: run `kubetron config --reference > docs/config-reference.md`")


def test_readme_names_the_two_commands_and_ci_runs_the_test_one():
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (REPO / ".ci" / "run").read_text()
