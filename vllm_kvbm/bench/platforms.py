"""Which compared configurations this machine's vLLM platform can run.

A configuration whose connector refuses the platform at startup is marked
"not supported" in ``kvbm-bench compare``'s report instead of being started
and raced: its row then says why, not how long a failing start took.
"""

from __future__ import annotations

# vLLM's own CPU offloading: the serve flag and the two connectors it can pick
NATIVE_OFFLOADING = ("vllm-offload", "offloading-connector", "simple-cpu-offload")


def unsupported_here(name: str) -> str:
    """Why configuration ``name`` cannot run on this machine's vLLM platform, or ''.
    vLLM 0.32's offloading refuses to start off CUDA/XPU ("CPU Offloading is
    currently only supported on CUDA-alike and XPU GPUs"), and LMCache 0.5.6's
    connector finds no CPU transfer path ("No supported cpu connector found")."""
    from vllm.platforms import current_platform as platform

    where = (
        "not supported on CPU"
        if platform.is_cpu()
        else f"not supported on {platform.device_name or platform.device_type}"
    )
    if name in NATIVE_OFFLOADING and not (platform.is_cuda_alike() or platform.is_xpu()):
        return f"{where}: vLLM's CPU offloading needs a CUDA-alike or XPU GPU"
    if name == "lmcache" and not platform.is_cuda_alike():
        return f"{where}: LMCacheConnectorV1 moves KV with a CUDA GPU"
    return ""
