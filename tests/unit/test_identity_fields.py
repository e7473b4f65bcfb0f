"""Every vLLM config field classified, for every supported release
(vllm_kvbm/identity_tables/), and config_identity on real configs.

The fields of each release come from its ``vllm/config`` sources, parsed with
ast (nothing imported): the installed vLLM from disk, the other releases out
of their wheels on PyPI (tools/vllm_wheels.py: range requests, cached under
~/.cache/vllm_kvbm). Network policy as tests/unit/test_vllm_compat.py: PyPI
answering with an error FAILS; no network at all and nothing cached skips
locally and fails under CI.

The values come from real configs: ``EngineArgs(...).create_engine_config()``
builds the VllmConfig an engine would run with, on CPU, without an engine.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from vllm_kvbm import identity_fields as idf
from vllm_kvbm import identity_tables as tables
from vllm_kvbm.canonical_values import canonical
from vllm_kvbm.config import SUPPORTED_VLLM
from vllm_kvbm.identity_tables.rules import HARMLESS, IDENTITY
from vllm_kvbm.tools import vllm_wheels as wheels

CONFIG_ROOT = "vllm/config/vllm.py"


# ---- fields from a release's sources ---------------------------------------------


def _module_paths(source: str, here: str) -> set[str]:
    """vllm/config modules a source imports (relative or absolute)."""
    package = here.rsplit("/", 1)[0].replace("/", ".")
    out = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.module is None and not node.level:
            continue
        if node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = f"{base}.{node.module}" if node.module else base
        else:
            module = node.module
        if module.startswith("vllm.config."):
            path = module.replace(".", "/")
            out |= {path + ".py", path + "/__init__.py"}
    return out


def config_sources(read) -> dict[str, str]:
    """vllm/config/vllm.py and every vllm/config module it reaches by import.

    ``read(members)`` returns the text of the members that exist."""
    texts: dict[str, str] = {}
    tried: set[str] = set()
    wanted = {CONFIG_ROOT}
    while wanted - tried:
        batch = sorted(wanted - tried)
        tried |= set(batch)
        got = read(batch)
        texts.update(got)
        for path, text in got.items():
            wanted |= _module_paths(text, path)
    assert CONFIG_ROOT in texts, "no vllm/config/vllm.py: vLLM moved VllmConfig"
    return texts


def _is_config_class(node: ast.ClassDef) -> bool:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return bool(names & {"config", "dataclass"})


def dataclass_fields(texts: dict[str, str]) -> dict[str, dict[str, str]]:
    """Config dataclasses of the sources: class -> field -> annotation.

    A field is a class-level annotated name that is not a ClassVar or an
    InitVar (init-only: not stored on the config)."""
    out: dict[str, dict[str, str]] = {}
    for text in texts.values():
        for node in ast.parse(text).body:
            if not isinstance(node, ast.ClassDef) or not _is_config_class(node):
                continue
            fields = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    ann = ast.unparse(item.annotation)
                    if not re.match(r"(typing\.|dataclasses\.)?(ClassVar|InitVar)\b", ann):
                        fields[item.target.id] = ann
            out[node.name] = fields
    return out


def unclassified(classes: dict[str, dict[str, str]], release: str) -> list[str]:
    """Problems: a config class reached from VllmConfig through identity (or
    unclassified) fields without a row, or a field of it without a rule."""
    problems = []
    todo, seen = [(tables.ROOT_CLASS, "VllmConfig")], set()
    while todo:
        cls, via = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        rules = tables.FIELDS.get(cls)
        if rules is None:
            problems.append(
                f"vLLM {release}: config class {cls} (reached through {via}) has no row in "
                f"FIELDS (vllm_kvbm/identity_tables/): add it with every field IDENTITY "
                f"or HARMLESS and why"
            )
            rules = {}
        for name, ann in classes[cls].items():
            rule = rules.get(name)
            if rule is None and cls in tables.FIELDS:
                problems.append(
                    f"vLLM {release}: {cls}.{name} ({ann}) is neither IDENTITY nor HARMLESS: "
                    f"add it to FIELDS['{cls}'] in vllm_kvbm/identity_tables/, I(...) if it "
                    f"can change the KV bytes of a prefix (or when unsure), else H('why not')"
                )
            if rule is not None and rule.kind == HARMLESS:
                continue
            for token in re.findall(r"[A-Za-z_]\w*", ann):
                if token in classes and token != cls:
                    todo.append((token, f"{cls}.{name}"))
    return problems


def _installed_reader():
    version, _ = wheels.installed_source(CONFIG_ROOT)
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    root = Path(list(spec.submodule_search_locations)[0]).parent

    def read(members):
        return {m: (root / m).read_text() for m in members if (root / m).is_file()}

    return version, read


def _releases():
    """(version, reader) of every supported release; the installed one from disk."""
    version, read = _installed_reader()
    out = {version: read}
    try:
        index, _ = wheels.fetch_index()
    except wheels.Offline as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must check every supported vLLM release, but: {err}")
        pytest.skip(f"no network and nothing cached: {err}")
    for release in wheels.list_releases(index):
        if release.version not in out:
            out[release.version] = lambda members, r=release: wheels.release_sources(
                r, members, optional=True
            )
    return out


@pytest.fixture(scope="module")
def release_fields() -> dict[str, dict[str, dict[str, str]]]:
    try:
        return {
            version: dataclass_fields(config_sources(read)) for version, read in _releases().items()
        }
    except wheels.Offline as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must check every supported vLLM release, but: {err}")
        pytest.skip(f"no network and nothing cached: {err}")


def test_every_release_is_read(release_fields):
    assert {v[:4] for v in release_fields} >= set(SUPPORTED_VLLM.series())


def test_every_field_of_every_release_is_classified(release_fields):
    problems = [
        p
        for version, classes in sorted(release_fields.items())
        for p in unclassified(classes, version)
    ]
    assert not problems, "\n".join(problems)


def test_table_names_only_real_fields(release_fields):
    """A row for a field no supported release has hides nothing, but misleads."""
    known = {
        (cls, name)
        for classes in release_fields.values()
        for cls, fields in classes.items()
        for name in fields
    }
    stale = [
        f"{cls}.{name}"
        for cls, rules in tables.FIELDS.items()
        for name in rules
        if (cls, name) not in known
    ]
    assert not stale, f"rows of FIELDS no supported vLLM has: {stale}"
    for cls, via in tables.HARMLESS_CLASSES.items():
        owner, field = via.split(".")
        assert tables.FIELDS[owner][field].kind == HARMLESS, via
        assert any(cls in classes for classes in release_fields.values()), cls


def test_harmless_fields_say_why():
    for cls, rules in tables.FIELDS.items():
        for name, rule in rules.items():
            assert rule.kind in (IDENTITY, HARMLESS), f"{cls}.{name}"
            if rule.kind == HARMLESS:
                assert len(rule.reason) > 8, f"{cls}.{name}: a harmless field needs a reason"


# ---- the checker catches a new field ----------------------------------------------


def test_checker_names_a_new_field_and_a_new_class():
    _, read = _installed_reader()
    texts = config_sources(read)
    cache = texts["vllm/config/cache.py"]
    old = "class CacheConfig:\n"
    assert cache.count(old) == 1, "cache.py changed, update this test"
    texts["vllm/config/cache.py"] = (
        cache.replace(
            old, old + "    kv_rotation: int = 0\n    tiling: TilingConfig | None = None\n", 1
        )
        + "\n@config\nclass TilingConfig:\n    tile: int = 0\n"
    )
    problems = unclassified(dataclass_fields(texts), "9.9.9")
    assert any(
        "vLLM 9.9.9: CacheConfig.kv_rotation (int) is neither IDENTITY nor "
        "HARMLESS: add it to FIELDS['CacheConfig']" in p
        for p in problems
    ), problems
    assert any(
        "config class TilingConfig (reached through CacheConfig.tiling) has no row" in p
        for p in problems
    ), problems
    assert len(problems) == 3, problems  # kv_rotation, tiling, TilingConfig


def test_init_only_and_class_vars_are_not_fields():
    src = (
        "from dataclasses import InitVar\nfrom typing import ClassVar\n@config\n"
        "class C:\n    a: int = 0\n    b: InitVar[int] = 0\n    c: ClassVar[int] = 0\n"
    )
    assert dataclass_fields({"x.py": src}) == {"C": {"a": "int"}}


# ---- the runtime config against the table -----------------------------------------


def _build(model_dir: Path, **overrides):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(
        model=str(model_dir),
        block_size=128,
        max_model_len=4096,
        dtype="float32",
        enable_prefix_caching=True,
    )
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


@pytest.fixture(scope="module")
def base_config(model_dir):
    return _build(model_dir)


def _runtime_classes(config) -> dict[str, set[str]]:
    """Fields (dataclasses.fields) of every config object reachable through
    fields that are not harmless."""
    out: dict[str, set[str]] = {}
    todo = [config]
    while todo:
        obj = todo.pop()
        cls = type(obj).__name__
        if cls in out:
            continue
        out[cls] = {f.name for f in dataclasses.fields(obj)}
        for f in dataclasses.fields(obj):
            rule = tables.FIELDS.get(cls, {}).get(f.name)
            value = getattr(obj, f.name, None)
            if (
                (rule is None or rule.kind == IDENTITY)
                and dataclasses.is_dataclass(value)
                and not isinstance(value, type)
            ):
                todo.append(value)
    return out


def test_runtime_fields_match_the_table_and_the_sources(base_config, release_fields):
    import vllm

    runtime = _runtime_classes(base_config)
    source = release_fields[vllm.__version__]
    for cls, names in runtime.items():
        if cls in source:  # config classes of vllm/config (others are values)
            assert names == set(source[cls]), (cls, names ^ set(source[cls]))
            assert names <= set(tables.FIELDS[cls]), (cls, names - set(tables.FIELDS[cls]))


def test_no_unknown_field_is_logged(base_config, caplog):
    idf._logged_unknown.clear()
    with caplog.at_level("INFO", logger=idf.__name__):
        idf.config_identity(base_config)
    assert "not classified" not in caplog.text


def test_an_unknown_field_counts_and_is_logged_once(base_config, caplog, monkeypatch):
    cache_rules = dict(tables.FIELDS["CacheConfig"])
    del cache_rules["block_size"]
    monkeypatch.setitem(tables.FIELDS, "CacheConfig", cache_rules)
    idf._logged_unknown.clear()
    with caplog.at_level("INFO", logger=idf.__name__):
        first = idf.config_identity(base_config)
        idf.config_identity(base_config)
    assert first["cache_config"]["block_size"] == 128
    # (one record may reach the capture twice: vllm_kvbm's records go out
    # through vLLM's logger, see plugin.py)
    logged = {id(r) for r in caplog.records if "CacheConfig.block_size" in r.getMessage()}
    assert len(logged) == 1, caplog.text


def test_identity_is_canonical_json(base_config):
    identity = idf.config_identity(base_config)
    text = idf.identity_json(base_config)
    assert json.loads(text) == [identity, idf.identity_env()]
    assert not re.search(r"0x[0-9a-f]{6,}|object at", text)
    model = identity["model_config"]
    assert model["dtype"] == "torch.float32"
    assert "_name_or_path" not in model["hf_config"]
    assert "transformers_version" not in model["hf_config"]
    # harmless fields are left out
    assert "model" not in model and "seed" not in model
    assert "instance_id" not in identity
    assert "kv_transfer_config" not in identity


def test_same_build_same_identity(base_config, model_dir, tmp_path):
    """Built twice (another random instance id, another seed, another path to
    the same files, other harmless settings): one identity."""
    copy = tmp_path / "copy"
    copy.symlink_to(model_dir.resolve(), target_is_directory=True)
    again = _build(copy, seed=7, max_num_seqs=3, gpu_memory_utilization=0.5)
    assert again.instance_id != base_config.instance_id
    assert idf.identity_json(again) == idf.identity_json(base_config)


@pytest.mark.parametrize(
    "overrides, where",
    [
        (dict(hf_overrides={"rope_theta": 10000.0}), "model_config"),
        (
            dict(hf_overrides={"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}),
            "model_config",
        ),
        (dict(dtype="bfloat16"), "model_config"),
        (dict(kv_cache_dtype="fp8"), "cache_config"),
        (dict(enforce_eager=True), "model_config"),
        (dict(max_model_len=2048), "model_config"),
    ],
)
def test_a_setting_that_changes_kv_changes_the_identity(base_config, model_dir, overrides, where):
    other = _build(model_dir, **overrides)
    a = idf.config_identity(base_config)
    b = idf.config_identity(other)
    assert a[where] != b[where]
    assert {k for k in a if a[k] != b[k]} <= {where, "compilation_config"}


def test_block_size_is_left_to_the_kv_cache_spec(base_config, model_dir):
    """vLLM's engine core resets cache_config.block_size from the KV cache
    groups in its own process (v1/engine/core.py), not in the workers': the
    namespace takes the block size from the KV cache spec (identity.py), so
    config_identity must not carry the scheduler's copy."""
    other = _build(model_dir, block_size=256)
    assert other.cache_config.block_size == 256
    assert idf.identity_json(other) == idf.identity_json(base_config)


def test_rope_override_reaches_the_effective_hf_config(model_dir):
    other = _build(model_dir, hf_overrides={"rope_theta": 12345.0})
    hf = idf.config_identity(other)["model_config"]["hf_config"]
    assert "12345.0" in json.dumps(hf)


def test_env_counts_every_vllm_variable_not_reviewed_as_harmless():
    """Unreviewed VLLM_* variables change the namespace (both change the KV:
    the MoE routing, the precision of float32 matmuls), so does one vLLM
    adds later; the reviewed harmless ones and other programs' do not."""
    env = {
        "VLLM_KV_CACHE_LAYOUT": "HND",
        "VLLM_ROCM_USE_AITER": "1",
        "VLLM_PORT": "8000",
        "VLLM_LOGGING_LEVEL": "DEBUG",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "HOME": "/x",
        "VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random",
        "VLLM_FLOAT32_MATMUL_PRECISION": "tf32",
        "VLLM_A_VARIABLE_OF_A_LATER_RELEASE": "1",
        "VLLM_DIST_IDENT": "tmpab12cd",
        "TORCH_HOME": "/y",
    }
    assert idf.identity_env(env) == {
        "VLLM_A_VARIABLE_OF_A_LATER_RELEASE": "1",
        "VLLM_FLOAT32_MATMUL_PRECISION": "tf32",
        "VLLM_KV_CACHE_LAYOUT": "HND",
        "VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random",
        "VLLM_ROCM_USE_AITER": "1",
    }
    assert idf.identity_env({"VLLM_FLOAT32_MATMUL_PRECISION": "ieee"}) != idf.identity_env(
        {"VLLM_FLOAT32_MATMUL_PRECISION": "tf32"}
    )


def test_env_harmless_names_exist_in_vllm_and_each_has_a_reason():
    """Every variable reviewed as harmless is one vLLM reads (a typo would
    count the real one as identity: safe, but a review lost)."""
    import vllm.envs as envs

    from vllm_kvbm.identity_tables.environment import HARMLESS_ENV, UNDECLARED_BY_VLLM

    names = set(envs.environment_variables) | UNDECLARED_BY_VLLM
    assert set(HARMLESS_ENV) <= names, set(HARMLESS_ENV) - names
    assert all(name.startswith("VLLM_") and reason for name, reason in HARMLESS_ENV.items())
    # the two measured to change the KV are not among them
    assert not {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY", "VLLM_FLOAT32_MATMUL_PRECISION"} & set(
        HARMLESS_ENV
    )


def test_canonical_values():
    import enum

    import torch

    class Color(enum.Enum):
        RED = "red"

    class Opaque:
        __slots__ = ()

    value = {
        "b": [Color.RED, torch.float16, Path("/a")],
        "a": {3, 1},
        2: None,
        "hf_token": "hf_secret",
        "fn": len,
        "o": Opaque(),
    }
    out = canonical(value)
    assert list(out) == sorted(out)
    assert out["b"] == ["red", "torch.float16", "/a"] and out["a"] == [1, 3]
    assert out["2"] is None and out["hf_token"] == "<redacted>"
    assert "0x" not in json.dumps(out)
