"""docs/configuration.md's table for users coming from LMCache or vLLM's own
offloading names settings that exist: each LMCache setting in the installed
LMCache's definitions, each vLLM one in the installed vLLM, each KVBM key in
KVBM's configuration, and the sizes it converts read as it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_kvbm.config import load_config
from vllm_kvbm.config import _KEYS as CONFIG_KEYS

ROOT = Path(__file__).resolve().parents[2]


def table() -> list[tuple[str, str, str]]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## Coming from LMCache or vLLM's own offloading", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][2:]
    return [tuple(c.strip() for c in row.strip("|").split(" | ")) for row in rows]


def names(cell: str) -> list[str]:
    """The setting names in a cell's code spans (``name: value`` or ``name``)."""
    return [re.split(r"[:= ]", span)[0] for span in re.findall(r"`([^`]+)`", cell)]


def test_every_row_names_real_settings():
    from lmcache.v1.config import _CONFIG_DEFINITIONS
    import vllm.config.cache as vllm_cache
    import vllm.config.vllm as vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config as offload

    vllm_text = "".join(Path(m.__file__).read_text() for m in (vllm_cache, vllm_config, offload))
    rows = table()
    assert len(rows) >= 12, rows
    for yours, _, kvbm in rows:
        if "(LMCache)" in yours:
            for name in names(yours):
                assert name in _CONFIG_DEFINITIONS, (name, yours)
        elif "(vLLM)" in yours or "OffloadingConnector" in yours:
            for name in names(yours):
                if name[0].isupper():
                    continue  # the connector's class name
                flag = name.lstrip("-").split(".")[-1].replace("-", "_")
                assert flag in vllm_text or flag.startswith("kv_events"), (name, yours)
        for name in names(kvbm):
            if re.fullmatch(r"[a-z_]+", name) and not name.startswith(("kv_", "lmcache")):
                if name in ("true", "false"):
                    continue
                assert name in CONFIG_KEYS, (name, kvbm)


@pytest.mark.parametrize("lmcache_gb", [5, 0.5])
def test_lmcache_sizes_map_to_the_same_bytes(lmcache_gb):
    """LMCache's max_local_cpu_size N is N * 1024^3 bytes (its storage
    backends' conversion); the table's ``NGiB`` reads as the same in KVBM."""
    import inspect

    from lmcache.v1.storage_backend import local_cpu_backend

    assert "max_local_cpu_size * 1024**3" in inspect.getsource(local_cpu_backend)
    mib = int(lmcache_gb * 1024)
    cfg = load_config({"host_cache_size": f"{mib}MiB"}, environ={})
    assert cfg.host_cache_bytes == int(lmcache_gb * 1024**3)
