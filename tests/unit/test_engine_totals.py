"""The startup line with what the whole engine takes (sizes are per worker)."""

from __future__ import annotations

from vllm_kvbm.config import load_config

MiB = 1024**2


def test_totals_multiply_the_per_worker_sizes_by_the_workers(tmp_path):
    config = load_config(
        {"host_cache_size": "16GiB", "disk_cache_dir": str(tmp_path), "disk_cache_size": "100GiB"},
        environ={},
    )
    # 16 GiB of 2 MiB pages per worker, TP=8
    text = config.engine_totals(16 * 1024 // 2, 2 * MiB, 8)
    assert "host tier 16.00 GiB per worker x 8 worker(s) = 128.00 GiB of host RAM" in text
    assert f"disk tier 100.00 GiB per worker x 8 = up to 800.00 GiB in {tmp_path}" in text
    assert "(host_cache_size and disk_cache_size are per worker;" in text


def test_host_total_is_the_whole_pages_allocated_and_no_disk_without_a_disk_tier():
    config = load_config({"host_cache_size": "1GiB"}, environ={})
    page = 3 * MiB  # 1 GiB holds 341 whole pages: 1023 MiB allocated
    slots = config.host_slots(page)
    text = config.engine_totals(slots, page, 1)
    assert text.startswith(f"host tier {slots * page / 1024**3:.2f} GiB per worker x 1 worker(s)")
    assert "disk" not in text.split("(")[0]
