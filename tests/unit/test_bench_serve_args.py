"""kvbm-bench's serve arguments for the servers it starts (vllm_kvbm.bench.serve_args),
read back as vLLM's own EngineArgs parses them: the CPU demo defaults, each replaced
by an argument after `--` or --serve-arg, vLLM's defaults elsewhere."""

from __future__ import annotations

import argparse

import pytest

pytestmark = pytest.mark.timeout(300)


# ---- the serve arguments of started servers --------------------------------------------


def _serve_namespace(*given: str, profile: str | None = "cpu", blocks=None, block_size=None):
    return argparse.Namespace(
        serve_defaults=profile,
        engine_kv_blocks=blocks,
        block_size=block_size,
        serve_arg=[],
        serve_passthrough=list(given),
    )


def _as_vllm_reads(flags: list[str]):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "m", *flags])


def test_serve_defaults_are_the_cpu_demos_and_each_can_be_replaced():
    from vllm_kvbm.bench.serve_args import serve_args

    cpu = _as_vllm_reads(serve_args(_serve_namespace()))
    assert (
        cpu.block_size,
        cpu.num_gpu_blocks_override,
        cpu.max_model_len,
        cpu.max_num_batched_tokens,
    ) == (128, 48, 47 * 128, 47 * 128)
    assert cpu.gpu_memory_utilization == 0.3 and cpu.enforce_eager and cpu.seed == 0
    # after --: each replaces its default, whatever its spelling
    flags = serve_args(
        _serve_namespace(
            "--gpu-memory-utilization",
            "0.9",
            "--no-enforce-eager",
            "--max_model_len=8192",
            "--kv-cache-dtype",
            "auto",
        )
    )
    gpu = _as_vllm_reads(flags)
    assert gpu.gpu_memory_utilization == 0.9 and not gpu.enforce_eager
    assert gpu.max_model_len == 8192 and gpu.num_gpu_blocks_override == 48
    assert flags.count("--enforce-eager") == 0 and "0.3" not in flags
    # --serve-arg, split as a shell would, does the same
    args = _serve_namespace()
    args.serve_arg = ["--max-model-len 1024", "--seed=7"]
    assert _as_vllm_reads(serve_args(args)).seed == 7
    assert serve_args(args)[-3:] == ["--max-model-len", "1024", "--seed=7"]
    # elsewhere vLLM's own defaults; a cache size asked for comes with its model length
    assert serve_args(_serve_namespace(profile="none")) == ["--seed", "0"]
    sized = _as_vllm_reads(serve_args(_serve_namespace(profile="none", blocks=100, block_size=16)))
    assert (sized.num_gpu_blocks_override, sized.max_model_len, sized.block_size) == (
        100,
        99 * 16,
        16,
    )
    assert sized.gpu_memory_utilization != 0.3 and not sized.enforce_eager
