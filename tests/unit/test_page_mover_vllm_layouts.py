"""PageMover / block_regions on vLLM's declared KV layouts (real NIXL, UCX
loopback, CPU memory; and the threaded host copies, host_copies.py): the test layouts match vLLM 0.32's own views, the block
dimension comes from vLLM's shape function where the shape is ambiguous, and a
layout whose pages are not contiguous is an error, never wrong bytes."""

from __future__ import annotations

import pytest
import torch

from helpers.kv_layouts import VLLM_LAYOUTS, agent_name, flash_layout, layer_name, vllm_layout
from test_page_mover import make_pool, wait
from test_page_mover import gen, movers  # noqa: F401 (fixtures)
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.worker import host_copies
from vllm_kvbm.worker.page_mover import PageMover, block_regions


# ---- the block dim from vLLM's declared layout ------------------------------


def vllm_views(
    lay_name, num_layers, num_blocks, heads, block_size, head_size, mla=False, kernel_split=1
):
    """vLLM 0.32's own per-layer views (create_kv_cache_views) over a fresh buffer."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    if mla:
        spec = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=torch.bfloat16
        )
    else:
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16
        )
    layout = KVCacheLayout[lay_name]
    names = [layer_name(i) for i in range(num_layers)]
    ls, bs, *_ = compute_layout_strides(spec, num_blocks, num_layers, layout)
    tensor = KVCacheTensor(
        size=num_layers * num_blocks * spec.page_size_bytes,
        layers=names,
        layer_stride=ls,
        block_stride=bs,
    )
    raw = torch.empty(tensor.size, dtype=torch.int8)
    kernel = block_size // kernel_split if kernel_split > 1 else None
    return (
        spec,
        raw,
        dict(zip(names, create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel))),
    )


@pytest.mark.parametrize(
    "lay_name,mla,kernel_split",
    [
        (name, mla, split)
        for name in sorted(VLLM_LAYOUTS)
        for mla, split in [(False, 1), (True, 1), (False, 2)]
        if split == 1 or name.startswith("LB")
    ],
)  # vLLM splits only layer-outer layouts
def test_vllm_layout_matches_vllms_own_views(lay_name, mla, kernel_split):
    _, raw, theirs = vllm_views(lay_name, 3, 10, 2, 16, 8, mla, kernel_split)
    ours = vllm_layout(
        lay_name, 3, 10, 2, 16, 8, gen=None, mla=mla, kernel_split=kernel_split, pad=0
    )
    for (n1, a), (n2, b) in zip(ours.caches.items(), theirs.items()):
        assert n1 == n2 and a.shape == b.shape and a.stride() == b.stride()
        assert a.dtype == b.dtype
        assert a.data_ptr() - ours.raw[0].data_ptr() == b.data_ptr() - raw.data_ptr()


def test_declared_block_dims_come_from_vllms_shape_function():
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from vllm_kvbm.worker.vllm_layout import declared_block_dims

    # num_blocks == num_kv_heads: two dims of size num_blocks
    spec, _, views = vllm_views("LBNHC", 2, 2, 2, 16, 8)
    cfg = KVCacheConfig(
        num_blocks=2, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(views), spec)]
    )
    assert declared_block_dims(cfg, views) == {name: 0 for name in views}
    # a layer vLLM declares nothing for is left to the shape
    assert declared_block_dims(cfg, {"other": torch.zeros(2, 3)}) == {}


def test_ambiguous_block_dim_without_declared_layout_is_an_error(gen):
    # The old flash layout [2, num_blocks, ...] with num_blocks == 2: "the first
    # dim of size num_blocks" is the K/V dim, whose pages are other bytes.
    lay = flash_layout(num_layers=2, num_blocks=2, block_size=4, heads=2, head_dim=8, gen=gen)
    with pytest.raises(KVBMConfigError, match=r"dimensions \[0, 1, 3\] all have size"):
        block_regions(lay.caches, 2)
    # vLLM 0.32 with num_blocks == num_kv_heads
    lay = vllm_layout("LBNHC", 2, 2, heads=2, block_size=4, head_size=8, gen=gen)
    with pytest.raises(KVBMConfigError, match="all have size num_blocks=2"):
        block_regions(lay.caches, 2)


@pytest.mark.parametrize(
    "case",
    ["flash_nb2", "nb_eq_heads", "nb_eq_block_size", "kernel_split", "mla", "LHBNC", "BLHNC"],
)
@pytest.mark.parametrize("path", ["nixl", "threads"])
def test_declared_block_dim_round_trip(case, path, gen, movers, monkeypatch):
    if case == "flash_nb2":  # [2, nb, bs, h, hd], nb == 2: the block dim is 1
        lay = flash_layout(num_layers=2, num_blocks=2, block_size=4, heads=2, head_dim=8, gen=gen)
        lay.block_dims = {name: 1 for name in lay.caches}
    elif case == "nb_eq_heads":
        lay = vllm_layout("LBNHC", 3, 4, heads=4, block_size=4, head_size=8, gen=gen)
    elif case == "nb_eq_block_size":
        lay = vllm_layout("LBHNC", 3, 4, heads=2, block_size=4, head_size=8, gen=gen)
    elif case == "kernel_split":  # the view has 2 kernel blocks per block
        lay = vllm_layout(
            "LBNHC", 3, 6, heads=2, block_size=8, head_size=8, gen=gen, kernel_split=2
        )
        assert next(iter(lay.caches.values())).shape[0] == 12
    elif case == "mla":
        lay = vllm_layout("LBNHC", 3, 6, heads=1, block_size=4, head_size=32, gen=gen, mla=True)
    else:
        lay = vllm_layout(case, 3, 6, heads=2, block_size=4, head_size=8, gen=gen)
    nb = lay.num_blocks
    pool = make_pool(nb, lay.block_bytes(), gen)
    if path == "nixl":
        mover = PageMover(lay.caches, nb, pool, name=agent_name(), block_dims=lay.block_dims)
        assert mover.block_bytes == lay.block_bytes()
    else:  # the other host-memory path, its copies cut small and shared by 3 threads
        monkeypatch.setattr(host_copies, "PIECE_BYTES", 64)
        monkeypatch.setattr(host_copies, "HELP_BYTES", 0)
        mover = host_copies.HostCopies(lay.caches, nb, pool, lay.block_dims, threads=3)
    movers.append(mover)
    slots = list(range(nb))[::-1]
    assert wait(mover, mover.post(True, list(range(nb)), slots)) == "DONE"
    for b, s in zip(range(nb), slots):
        assert torch.equal(pool[s], lay.slot_bytes(b)), (case, b)
    # load block 0's page into block nb-1 only; everything else untouched
    expected = lay.clone_raw()
    lay.copy_block(expected, 0, nb - 1)
    assert wait(mover, mover.post(False, [nb - 1], [slots[0]])) == "DONE"
    assert lay.raw_equal(expected)


def test_unsupported_vllm_layout_is_an_error_not_wrong_bytes(gen):
    # BHLNC: a layer's page is split by heads inside the block
    lay = vllm_layout("BHLNC", 3, 6, heads=2, block_size=4, head_size=8, gen=gen)
    with pytest.raises(KVBMConfigError, match="not contiguous"):
        block_regions(lay.caches, 6, lay.block_dims)
    # a declared dim that does not hold num_blocks
    with pytest.raises(KVBMConfigError, match="not a multiple of num_blocks=6"):
        block_regions(lay.caches, 6, {name: 1 for name in lay.caches})
