"""scripts/clean_tiers.py on real disk stores: the files of a generation no
running engine holds (a store closed, as an engine before an upgrade) are
deleted, the running store's pages stay and still read, nothing else in the
directory is touched; --all refuses while a store runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import ROOT
from vllm_kvbm.tiers.disk.store import DiskStore

pytestmark = pytest.mark.timeout(120)

PAGE = 64 << 10
SCRIPT = ROOT / "scripts" / "clean_tiers.py"


def page(seed: int) -> torch.Tensor:
    return torch.full((PAGE,), seed % 251, dtype=torch.uint8)


def fill(store: DiskStore, n: int, first: int = 0) -> list[bytes]:
    keys = [bytes([first + i]) * 32 for i in range(n)]
    for i, key in enumerate(keys):
        assert store.put(key, page(first + i))
    return keys


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60
    )


def kvbm_files(directory) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith(("kvbm_", ".kvbm-"))}


def test_only_generations_no_engine_holds_are_deleted(tmp_path):
    # An engine before the upgrade (another namespace: another vLLM release), its
    # write cut short, and a data-parallel rank's directory; then the running one.
    old = DiskStore(str(tmp_path), 8 << 20, PAGE, "vllm-0.32.0", 0, 1)
    fill(old, 4)
    old.close()
    old_rank = DiskStore(str(tmp_path / "dp1"), 8 << 20, PAGE, "vllm-0.32.0", 0, 1)
    fill(old_rank, 2)
    old_rank.close()
    stale = kvbm_files(tmp_path)
    [a_page] = [n for n in stale if n.endswith(".pt")][:1]
    (tmp_path / (a_page + ".tmp")).write_bytes(b"cut short")
    (tmp_path / "notes.txt").write_text("not KVBM's")
    (tmp_path / "kvbm_not_a_page.pt").write_text("not a name KVBM writes")
    new = DiskStore(str(tmp_path), 8 << 20, PAGE, "vllm-0.33.0", 0, 1)
    try:
        keys = fill(new, 3, first=10)
        live = kvbm_files(tmp_path) - stale - {a_page + ".tmp", "kvbm_not_a_page.pt"}
        assert len(live) == 4  # three pages and the running store's lock

        dry = run("disk", tmp_path, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        # here 4 pages, a .tmp and a lock; in dp1 2 pages and a lock
        assert "would delete 9 files" in dry.stdout
        assert kvbm_files(tmp_path) >= stale

        proc = run("disk", tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "deleted 9 files" in proc.stdout
        assert kvbm_files(tmp_path) == live | {"kvbm_not_a_page.pt"}
        assert (tmp_path / "notes.txt").exists()
        assert kvbm_files(tmp_path / "dp1") == set()  # no engine holds that one either
        out = torch.empty(PAGE, dtype=torch.uint8)
        for i, key in enumerate(keys):  # the running store's pages read as before
            assert new.get_into(key, out) == "ok" and torch.equal(out, page(10 + i))

        refused = run("disk", tmp_path, "--all")
        assert refused.returncode != 0 and "stop them before --all" in refused.stderr
        assert kvbm_files(tmp_path) == live | {"kvbm_not_a_page.pt"}
    finally:
        new.close()
    proc = run("disk", tmp_path, "--all")
    assert proc.returncode == 0, proc.stderr
    assert kvbm_files(tmp_path) == {"kvbm_not_a_page.pt"}
    assert (tmp_path / "notes.txt").exists()


def test_a_missing_directory_is_an_error(tmp_path):
    proc = run("disk", tmp_path / "nowhere")
    assert proc.returncode != 0 and "is not a directory" in proc.stderr
