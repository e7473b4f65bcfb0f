"""The KV cache layout KVBM asks vLLM for (engine_info.py), as vLLM 0.32 resolves it.

vLLM's own resolver (``resolve_kv_cache_layout``, run in the engine core)
decides, from a real VllmConfig naming KVBMConnector and the layouts the
workers' attention backends declare. Only the platform's ``is_cuda`` is
set: there is no CUDA runtime here, and the other cases must hold on a GPU host.
"""

from __future__ import annotations

import pytest
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.platforms import current_platform
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

# What the workers report (vllm/v1/attention/backends/*.py): backends that
# declare nothing (FlashAttention, FlashInfer before Blackwell) give vLLM's
# default preference; FlashInfer on SM100, the CPU and Flex backends their own.
ANY_LAYOUT = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
FLASHINFER_SM100 = ["LBHNC", "BLHNC"]
CPU_ATTN = ["LBHNC"]
FLEX = ["LBNHC"]


def resolved(supported: list[str], block_size: int = 16) -> str:
    config = VllmConfig(
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBMConnector",
            kv_connector_module_path="vllm_kvbm.connector",
            kv_role="kv_both",
        ),
    )
    return resolve_kv_cache_layout(config, [supported]).name


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)


@pytest.mark.parametrize("supported", [ANY_LAYOUT, FLASHINFER_SM100])
def test_on_cuda_blocks_are_laid_out_block_by_block_across_layers(on_cuda, supported):
    # vLLM's default would be LBNHC (or LBHNC): layer by layer, 1,280
    # copies per 70B page instead of one (test_copy_engine.py).
    assert resolved(supported) == "BLHNC"


def test_a_backend_that_refuses_it_keeps_its_own_layout(on_cuda):
    assert resolved(FLEX) == "LBNHC"


def test_not_asked_where_vllm_would_split_blocks_for_the_kernel(on_cuda):
    # 128-token blocks with FlashInfer (kernel blocks up to 64) would make
    # vLLM refuse a block-outer layout at startup.
    assert resolved(ANY_LAYOUT, block_size=128) == "LBNHC"


def test_not_asked_off_cuda(monkeypatch):
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)  # CPU, ROCm
    assert resolved(CPU_ATTN) == "LBHNC"
    assert resolved(ANY_LAYOUT) == "LBNHC"  # vLLM's own first choice, untouched
