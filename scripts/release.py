"""The release's checks, run by .github/workflows/release.yml on a tag vX.Y.Z
(docs/development.md#releasing):

    python scripts/release.py check vX.Y.Z          the tag names pyproject.toml's version,
                                                    CHANGELOG.md dates it and links its tag
    python scripts/release.py notes vX.Y.Z          that version's CHANGELOG.md section
    python scripts/release.py check-dist vX.Y.Z DIR DIR holds that version's wheel and sdist,
                                                    and nothing else

Each exits non-zero with a message naming what to fix.
"""

from __future__ import annotations

import re
import sys
import tarfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO = "https://github.com/vllm-kvbm/vllm-kvbm"


class ReleaseError(Exception):
    pass


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def version_of(tag: str) -> str:
    """The version a release tag names, checked against pyproject.toml's."""
    declared = project()["version"]
    if tag != f"v{declared}":
        raise ReleaseError(
            f"tag {tag!r} does not name pyproject.toml's version {declared!r}: "
            f"tag v{declared}, or bump the version first"
        )
    return declared


def changelog_section(version: str, changelog: str | None = None) -> str:
    """The body of ``## [version] - YYYY-MM-DD`` in CHANGELOG.md."""
    text = (ROOT / "CHANGELOG.md").read_text() if changelog is None else changelog
    match = re.search(
        rf"^## \[{re.escape(version)}\] - (\d{{4}}-\d{{2}}-\d{{2}})\n(.*?)(?=^## |\Z)",
        text,
        re.M | re.S,
    )
    if match is None:
        raise ReleaseError(
            f"CHANGELOG.md has no '## [{version}] - YYYY-MM-DD' section: move "
            f"[Unreleased]'s entries under it, dated the release day"
        )
    body = re.sub(r"^\[[^\]]+\]: \S+\n?", "", match.group(2), flags=re.M).strip()
    if not body:
        raise ReleaseError(f"CHANGELOG.md's [{version}] section is empty")
    return body


def check(tag: str) -> str:
    version = version_of(tag)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    changelog_section(version, changelog)
    links = dict(re.findall(r"^\[([^\]]+)\]: (\S+)$", changelog, re.M))
    unreleased = f"{REPO}/compare/{tag}...HEAD"
    if links.get("Unreleased") != unreleased:
        raise ReleaseError(
            f"CHANGELOG.md: the link [Unreleased] must be {unreleased}, "
            f"found {links.get('Unreleased')!r}"
        )
    # the first tagged release links its tag, each later one the comparison with the one before
    url = links.get(version, "")
    if not (
        url == f"{REPO}/releases/tag/{tag}"
        or re.fullmatch(rf"{re.escape(REPO)}/compare/v[\w.]+\.\.\.{re.escape(tag)}", url)
    ):
        raise ReleaseError(
            f"CHANGELOG.md: the link [{version}] must be {REPO}/compare/"
            f"vPREVIOUS...{tag} (or {REPO}/releases/tag/{tag} for the first "
            f"tag), found {url!r}"
        )
    if "## [Unreleased]" not in changelog:
        raise ReleaseError("CHANGELOG.md has no '## [Unreleased]' section above the release")
    return version


def check_dist(tag: str, directory: Path) -> list[str]:
    version = version_of(tag)
    files = sorted(p.name for p in directory.iterdir())
    wheel, sdist = f"vllm_kvbm-{version}-py3-none-any.whl", f"vllm_kvbm-{version}.tar.gz"
    if files != sorted([wheel, sdist]):
        raise ReleaseError(f"{directory} holds {files}; expected exactly {wheel} and {sdist}")
    with zipfile.ZipFile(directory / wheel) as zf:
        metadata = Parser().parsestr(zf.read(f"vllm_kvbm-{version}.dist-info/METADATA").decode())
        names = zf.namelist()
    with tarfile.open(directory / sdist) as tf:
        members = tf.getnames()
    problems = []
    if metadata["Version"] != version:
        problems.append(f"the wheel's version is {metadata['Version']}")
    if metadata["Requires-Python"] != project()["requires-python"]:
        problems.append(
            f"the wheel requires Python {metadata['Requires-Python']}, pyproject.toml "
            f"{project()['requires-python']}"
        )
    if not any(n.endswith("entry_points.txt") for n in names):
        problems.append("the wheel has no entry points (the vllm.general_plugins plugin)")
    for needed in ("pyproject.toml", "LICENSE", "README.md", "vllm_kvbm/connector.py"):
        if f"vllm_kvbm-{version}/{needed}" not in members:
            problems.append(f"the sdist lacks {needed}")
    if problems:
        raise ReleaseError("; ".join(problems))
    return [wheel, sdist]


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 2 and argv[0] == "check":
            print(f"release: {argv[1]} is version {check(argv[1])}, dated in CHANGELOG.md")
        elif len(argv) == 2 and argv[0] == "notes":
            print(changelog_section(version_of(argv[1])))
        elif len(argv) == 3 and argv[0] == "check-dist":
            print(f"release: {', '.join(check_dist(argv[1], Path(argv[2])))}")
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except ReleaseError as err:
        print(f"release: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
