"""The dtype rule of the demo, benchmarks and tests (vllm_kvbm/tools/compute_dtype.py)."""

import pytest
import torch

from vllm_kvbm.tools import compute_dtype as cd


def test_follows_the_cpus_native_bf16(monkeypatch):
    monkeypatch.delenv(cd.ENV, raising=False)
    caps = torch.cpu.get_capabilities()
    native = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    assert cd.native_bf16() is native
    assert cd.compute_dtype() == ("bfloat16" if native else "float32")
    assert cd.compute_dtype() in cd.describe()


@pytest.mark.parametrize(
    "caps,expected",
    [
        ({"avx2": True, "avx512_bf16": False, "amx_bf16": False}, "float32"),
        ({"avx512_f": True, "avx512_bf16": False, "amx_bf16": False}, "float32"),
        ({"avx512_f": True, "avx512_bf16": True, "amx_bf16": False}, "bfloat16"),
        ({"avx512_f": True, "avx512_bf16": False, "amx_bf16": True}, "bfloat16"),
    ],
)
def test_x86_rule(monkeypatch, caps, expected):
    monkeypatch.delenv(cd.ENV, raising=False)
    monkeypatch.setattr(cd.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert cd.compute_dtype() == expected


def test_override_and_bad_value(monkeypatch):
    monkeypatch.setenv(cd.ENV, "bfloat16")
    assert cd.compute_dtype() == "bfloat16"
    assert "KVBM_DTYPE is set" in cd.describe()
    monkeypatch.setenv(cd.ENV, "bf16")
    with pytest.raises(ValueError, match="KVBM_DTYPE='bf16'.*bfloat16, float32"):
        cd.compute_dtype()
