"""The dtype the demo, the benchmarks and the tests run the model in.

On a CPU without native bf16 (x86 without AVX512_BF16 or AMX, such as an
AVX2-only EPYC), PyTorch and oneDNN emulate bf16 matmuls, tens of times
slower than fp32 ("Failed to create oneDNN linear, fallback to torch
linear" in vLLM's log): a prefill timed there measures the emulation, not
the model. Such CPUs run float32; CPUs with native bf16 (and GPUs) run
bfloat16, the dtype real models ship in. One rule, so that a figure means
the same on both kinds of host.

``KVBM_DTYPE`` overrides the choice (``bfloat16``, ``float32`` or
``float16``), for example to time bf16 on any CPU.
"""

from __future__ import annotations

import os
import platform

DTYPES = ("bfloat16", "float32", "float16")
ENV = "KVBM_DTYPE"


def native_bf16() -> bool:
    """True where bf16 matmuls run in hardware: a CUDA device, x86 with
    AVX512_BF16 or AMX-BF16, or an Arm CPU with the BF16 extension."""
    import torch

    if torch.cuda.is_available():
        return True
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
        if caps:
            return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
        return bool(torch.cpu._is_avx512_bf16_supported())
    if machine in ("aarch64", "arm64"):
        return "bf16" in _cpuinfo_flags()
    return False


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("flags", "features")):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def compute_dtype() -> str:
    """``bfloat16`` where the hardware has it natively, else ``float32``;
    ``KVBM_DTYPE`` wins when set."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if forced not in DTYPES:
            raise ValueError(
                f"{ENV}={forced!r}: expected one of {', '.join(DTYPES)} "
                f"(or unset it to choose from the CPU)"
            )
        return forced
    return "bfloat16" if native_bf16() else "float32"


def describe() -> str:
    """For a startup banner: the dtype and why."""
    import torch

    dtype = compute_dtype()
    if os.environ.get(ENV, "").strip():
        why = f"{ENV} is set"
    elif torch.cuda.is_available():
        why = "CUDA device"
    else:
        why = (
            f"CPU {torch.backends.cpu.get_cpu_capability()}, "
            f"{'native' if native_bf16() else 'no native'} bf16"
        )
    return f"{dtype} ({why})"
