"""The sources of every supported vLLM release, read out of its wheel on PyPI.

The installed vLLM is read from disk; every other release's members are read
out of its wheel on PyPI *without downloading or installing the wheel* (the
CUDA wheels pin a torch this environment cannot hold): HTTP range requests
fetch the zip's central directory and the few members needed, and those
members are cached under ``~/.cache/vllm_kvbm/vllm-wheels/<wheel>/`` (wheels
on PyPI never change, so the cache never goes stale). The list of releases
comes from PyPI's simple index (PEP 691 JSON; the legacy /pypi/vllm/JSON API
is not reachable from every network) on every run, so a new patch release in
the range is checked as soon as it is published. ``KVBM_CACHE_DIR`` moves the
cache.

Network: with no network at all (PyPI gives no HTTP answer), ``fetch_index``
returns the last index it fetched, from the cache, and says so; with nothing
cached it raises ``Offline``. Any other failure (an HTTP error, a server
ignoring ranges, a wheel without the member, a corrupt member) raises
``FetchError``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion

from vllm_kvbm.config.versions import SUPPORTED_VLLM, vllm_release

BASE_MEMBER = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
# What a compatibility review reads, besides the base class.
# (0.34 moved the worker mixin to vllm/v1/worker/{gpu,cpu}/kv_connector.py.)
REVIEW_MEMBERS = (
    BASE_MEMBER,
    "vllm/v1/metrics/cache_hit_source.py",
    "vllm/v1/core/sched/scheduler.py",
    "vllm/v1/worker/kv_connector_model_runner_mixin.py",
    "vllm/v1/worker/gpu/kv_connector.py",
    "vllm/v1/worker/cpu/kv_connector.py",
    "vllm/distributed/kv_transfer/kv_connector/utils.py",
)
INDEX_URL = "https://pypi.org/simple/vllm/"
TIMEOUT_S = 60


class FetchError(RuntimeError):
    """PyPI answered, but not with what the check needs."""


class Offline(FetchError):
    """PyPI could not be reached at all and nothing usable is cached."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVBM_CACHE_DIR", Path.home() / ".cache" / "vllm_kvbm"))


# ---- reading members of a remote zip ---------------------------------------


def _open_url(url: str, headers: dict[str, str] | None = None):
    request = urllib.request.Request(
        url, headers={"User-Agent": "vllm-kvbm-compat", **(headers or {})}
    )
    try:
        return urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as err:
        raise FetchError(f"GET {url}: HTTP {err.code} {err.reason}") from err
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise Offline(f"GET {url}: no answer ({reason})") from err


class RemoteFile:
    """A read-only, seekable file over HTTP range requests, read in blocks.

    ``zipfile`` reads the end-of-central-directory record, the central
    directory and then each opened member's header and data; only those
    blocks are fetched.
    """

    BLOCK = 256 * 1024

    def __init__(self, url: str, size: int | None = None):
        self.url = url
        self._blocks: dict[int, bytes] = {}
        self._pos = 0
        self.bytes_fetched = 0
        self.size = size if size is not None else self._content_length()

    def _content_length(self) -> int:
        with _open_url(self.url, {"Range": "bytes=0-0"}) as resp:
            rng = resp.headers.get("Content-Range", "")
            m = re.match(r"bytes 0-0/(\d+)$", rng)
            if resp.status != 206 or not m:
                raise FetchError(
                    f"{self.url}: the server ignores range requests "
                    f"(status {resp.status}, Content-Range {rng!r})"
                )
            return int(m.group(1))

    def _fetch(self, first: int, last: int) -> None:
        """Fetches blocks first..last (inclusive) in one request."""
        start = first * self.BLOCK
        end = min((last + 1) * self.BLOCK, self.size) - 1
        with _open_url(self.url, {"Range": f"bytes={start}-{end}"}) as resp:
            data = resp.read()
            if resp.status != 206 or len(data) != end - start + 1:
                raise FetchError(
                    f"{self.url}: asked for bytes {start}-{end}, got status "
                    f"{resp.status} with {len(data)} bytes"
                )
        self.bytes_fetched += len(data)
        for i in range(first, last + 1):
            off = (i - first) * self.BLOCK
            self._blocks[i] = data[off : off + self.BLOCK]

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self._pos
        n = max(0, min(n, self.size - self._pos))
        if n == 0:
            return b""
        first, last = self._pos // self.BLOCK, (self._pos + n - 1) // self.BLOCK
        missing = [i for i in range(first, last + 1) if i not in self._blocks]
        if missing:
            self._fetch(missing[0], missing[-1])
        data = b"".join(self._blocks[i] for i in range(first, last + 1))
        off = self._pos - first * self.BLOCK
        self._pos += n
        return data[off : off + n]

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


# ---- releases and their sources ----------------------------------------------


@dataclass(frozen=True)
class Release:
    version: str
    wheel: str  # file name
    url: str
    size: int


def _pick_wheel(files: list[tuple[dict, frozenset]]) -> dict | None:
    """The release's x86_64 wheel (any wheel holds the same Python sources);
    ``files``: (index entry, its wheel tags)."""
    wheels = [(f, tags) for f, tags in files if not f.get("yanked")]
    wheels.sort(
        key=lambda ft: (not any(t.platform.endswith("x86_64") for t in ft[1]), ft[0]["filename"])
    )
    return wheels[0][0] if wheels else None


def list_releases(index: dict) -> list[Release]:
    """Final (non pre-release) vLLM releases in SUPPORTED_VLLM with a wheel."""
    by_version: dict[str, list[tuple[dict, frozenset]]] = {}
    for f in index.get("files", []):
        try:
            name, version, _, tags = parse_wheel_filename(f["filename"])
        except (InvalidWheelFilename, InvalidVersion):
            continue  # an sdist or a name that is not a wheel's
        if name == "vllm" and not version.is_prerelease and version.local is None:
            by_version.setdefault(str(version), []).append((f, tags))
    releases = []
    for version, files in by_version.items():
        if not SUPPORTED_VLLM.contains(version):
            continue
        wheel = _pick_wheel(files)
        if wheel is not None:
            releases.append(
                Release(version, wheel["filename"], wheel["url"], int(wheel.get("size") or 0))
            )
    return sorted(releases, key=lambda r: vllm_release(r.version))


def fetch_index() -> tuple[dict, str]:
    """PyPI's index of vLLM files (PEP 691 JSON), or the cached copy if offline.

    Returns the index and where it came from.
    """
    cached = cache_dir() / "vllm-index.json"
    try:
        with _open_url(INDEX_URL, {"Accept": "application/vnd.pypi.simple.v1+json"}) as r:
            body = r.read()
        index = json.loads(body)
    except Offline:
        if cached.exists():
            return json.loads(cached.read_text()), f"cached {cached} (PyPI unreachable)"
        raise
    except ValueError as err:
        raise FetchError(f"{INDEX_URL}: not a JSON index ({err})") from err
    if "files" not in index:
        raise FetchError(f"{INDEX_URL}: JSON without a 'files' list")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_bytes(body)
    tmp.replace(cached)
    return index, INDEX_URL


def release_sources(
    release: Release, members: Iterable[str] = (BASE_MEMBER,), optional: bool = False
) -> dict[str, str]:
    """The text of ``members`` of the release's wheel, from the cache or PyPI.

    A member the wheel lacks is an error, or left out when ``optional``.
    """
    root = cache_dir() / "vllm-wheels" / release.wheel
    out: dict[str, str] = {}
    missing = []
    for member in members:
        path = root / member
        if path.exists():
            out[member] = path.read_text()
        elif (root / (member + ".absent")).exists():  # looked for before: not there
            if not optional:
                raise _not_in_wheel(release, member)
        else:
            missing.append(member)
    if not missing:
        return out
    remote = RemoteFile(release.url, release.size or None)
    try:
        zf = zipfile.ZipFile(remote)
    except zipfile.BadZipFile as err:
        raise FetchError(f"{release.wheel}: not a readable zip ({err})") from err
    with zf:
        names = set(zf.namelist())
        for member in missing:
            if member not in names and optional:
                (root / member).parent.mkdir(parents=True, exist_ok=True)
                (root / (member + ".absent")).touch()
                continue
            if member not in names:
                raise _not_in_wheel(release, member)
            try:
                data = zf.read(member)  # checks the member's CRC-32
            except (zipfile.BadZipFile, zlib.error, OSError) as err:
                raise FetchError(f"{release.wheel}: {member} is corrupt ({err})") from err
            path = root / member
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            out[member] = data.decode()
    return out


def python_sources(release: Release) -> Path:
    """A directory holding the release's ``vllm`` package without its compiled
    parts (every ``*.py`` of the wheel and its ``.dist-info``, about 13 MB
    fetched by range requests), cached. First on ``PYTHONPATH`` it is the vLLM
    that Python imports: enough for vLLM's Scheduler, which runs no compiled
    code, on the installed torch. (Its dist-info names the CUDA build, so on a
    machine without a GPU vLLM picks no platform instead of its CPU platform,
    which from 0.34 wants triton-cpu.)
    """
    root = cache_dir() / "vllm-src" / release.wheel
    if (root / ".complete").exists():
        return root
    remote = RemoteFile(release.url, release.size or None)
    remote.BLOCK = 1 << 20  # the members are read in order: fewer, larger requests
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(remote) as zf:
            infos = sorted(
                (
                    i
                    for i in zf.infolist()
                    if (i.filename.startswith("vllm/") and i.filename.endswith(".py"))
                    or (i.filename.split("/")[0].endswith(".dist-info") and not i.is_dir())
                ),
                key=lambda i: i.header_offset,
            )
            if not any(i.filename == "vllm/__init__.py" for i in infos):
                raise _not_in_wheel(release, "vllm/__init__.py")
            for info in infos:
                path = tmp / info.filename
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(zf.read(info))  # checks each member's CRC-32
    except (zipfile.BadZipFile, zlib.error) as err:
        raise FetchError(f"{release.wheel}: corrupt ({err})") from err
    (tmp / ".complete").touch()
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def _not_in_wheel(release: Release, member: str) -> FetchError:
    return FetchError(
        f"{release.wheel} has no {member}: vLLM moved it; update vllm_kvbm/tools/vllm_wheels.py"
    )


def installed_source(member: str = BASE_MEMBER) -> tuple[str, str]:
    """(version, text of member) of the installed vLLM."""
    import importlib.util

    import vllm

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(list(spec.submodule_search_locations)[0]).parent
    return vllm.__version__, (root / member).read_text()
