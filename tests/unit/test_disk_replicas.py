"""Data-parallel ranks of one deployment on one ``disk_cache_dir``.

DP replicas compute the same KV, so their pages have the same keys and file
names; each rank's store keeps an index and an LRU of its own, blind to the
other's writes and evictions. Each rank therefore keeps its pages in a
directory of its own under ``disk_cache_dir`` (rank 0 in it, rank r in
``dp<r>``), said at startup, and neither evicts the other's pages.
"""

from __future__ import annotations

import copy
import logging
import os

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.scheduler_harness import kvbm, make_scheduler  # noqa: E402
from helpers.tier_pages import key, phys  # noqa: E402
from vllm_kvbm.config import load_config  # noqa: E402
from vllm_kvbm.engine_info import engine_info  # noqa: E402
from vllm_kvbm.tiers.disk.store import DiskStore  # noqa: E402
from vllm_kvbm.tiers.disk.view import DiskView  # noqa: E402


def _dp_infos(n: int):
    """The EngineInfo each of ``n`` DP ranks of the harness engine derives:
    vLLM runs a dense model's DP ranks as engines of DP size 1, rank 0, and
    keeps the rank in parallel_config.data_parallel_index."""
    s = make_scheduler()
    page_tokens = kvbm(s).info.page_tokens
    infos = []
    for r in range(n):
        cfg = copy.deepcopy(s.vllm_config)
        cfg.parallel_config.data_parallel_index = r
        infos.append(engine_info(cfg, s.kv_cache_config, page_tokens=page_tokens))
    return infos


def test_dp_ranks_on_one_disk_cache_dir_keep_their_pages_apart(tmp_path, caplog):
    import torch

    infos = _dp_infos(2)
    assert infos[0].tier_namespace == infos[1].tier_namespace  # the same KV, the same keys
    page_bytes = infos[0].page_bytes
    config = load_config(
        {"disk_cache_dir": str(tmp_path), "disk_cache_size": f"{2 * phys(page_bytes)}B"}
    )
    # Both ranks' stores open (the second one was refused: the first's claim)
    stores = [DiskStore.from_config(config, info, 0, None, "") for info in infos]
    try:
        with caplog.at_level(logging.INFO):
            views = [DiskView.from_config(config, info, None) for info in infos]
        assert f"data-parallel rank 1 keeps its disk tier in {tmp_path / 'dp1'}" in caplog.text
        assert stores[0].directory == str(tmp_path)
        assert stores[1].directory == str(tmp_path / "dp1")
        zeros = torch.zeros(page_bytes, dtype=torch.uint8)
        pk = key(100)
        assert stores[0].put(pk, zeros)
        assert views[0].contains(pk) and not views[1].contains(pk)
        # Rank 1 fills its capacity twice over: rank 0's page stays.
        for i in range(4):
            assert stores[1].put(key(i), zeros)
        assert len(stores[1].take_removed()) == 2
        assert views[0].contains(pk)
        assert stores[0].take_removed() == []
    finally:
        for s in stores:
            s.close()
