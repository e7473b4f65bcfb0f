"""Bad kv_connector_extra_config stops the connector's start with a message
naming the key and the fix, on vLLM's real Scheduler (the same start the
engine core runs under `vllm serve`; tests/e2e/test_serve.py sees one such
message through a real `vllm serve`)."""

from __future__ import annotations

import pytest

from helpers.scheduler_harness import make_scheduler
from helpers.system import mount_tmpfs, umount


@pytest.fixture
def read_only_dir(tmp_path):
    mnt = tmp_path / "ro"
    mount_tmpfs(mnt, "size=1m,ro")
    yield mnt
    umount(mnt)


@pytest.mark.parametrize(
    "extra,expected",
    [
        (
            {"host_cache_sise": "1GiB"},
            ["unknown key 'host_cache_sise'", "did you mean 'host_cache_size'"],
        ),
        (
            {"host_cache_blocks": None, "host_cache_size": "1KiB"},
            [
                "host_cache_size: 1024 bytes cannot hold one KV page",
                "set host_cache_size to at least",
            ],
        ),
        (
            {"disk_cache_dir": "/nonexistent/kvbm-disk"},
            [
                "disk_cache_dir: directory '/nonexistent/kvbm-disk' does not exist",
                "mkdir -p /nonexistent/kvbm-disk",
            ],
        ),
    ],
)
def test_bad_config_stops_the_start_with_a_clear_message(extra, expected):
    with pytest.raises(Exception) as err:
        make_scheduler(**extra)
    for text in expected:
        assert text in str(err.value)


def test_unwritable_disk_dir_and_a_disk_tier_under_one_block_stop_the_start(
    read_only_dir, tmp_path
):
    with pytest.raises(Exception) as err:
        make_scheduler(disk_cache_dir=str(read_only_dir))
    assert f"disk_cache_dir: directory '{read_only_dir}' is not writable" in str(err.value)
    assert "set disk_cache_dir to a writable directory" in str(err.value)
    with pytest.raises(Exception) as err:
        make_scheduler(disk_cache_dir=str(tmp_path), disk_cache_size="1KiB")
    assert "disk_cache_size: 1024 bytes cannot hold one KV page" in str(err.value)
    assert "set disk_cache_size to at least" in str(err.value)
