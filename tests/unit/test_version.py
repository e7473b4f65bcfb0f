"""The version the package reports is the one pyproject.toml declares."""

import pytest

import vllm_kvbm
from helpers import ROOT


def test_package_reports_pyprojects_version():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert vllm_kvbm.__version__ == declared


def test_changelog_has_an_entry_for_the_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{vllm_kvbm.__version__}]" in changelog
    assert "## [Unreleased]" in changelog
