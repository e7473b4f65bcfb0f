"""The ``vllm serve`` arguments of the servers ``kvbm-bench compare`` starts.

Two sets of defaults. ``cpu`` (vLLM's CPU build): the demo's small engine, an
engine KV cache of 48 blocks of 128 tokens (too small for the default
workload's users, so that returning prompts leave vLLM's own cache), eager
mode and 0.3 of the memory. ``none`` (elsewhere, a GPU): vLLM's own, only a
fixed seed. Whatever the user gives (``--serve-arg``, or after ``--``)
replaces the default of the same flag (``--no-enforce-eager`` replaces
``--enforce-eager``).
"""

from __future__ import annotations

import re
import shlex

CPU_BLOCKS = 48
CPU_BLOCK_SIZE = 128


def default_profile() -> str:
    """``cpu`` on vLLM's CPU build, ``none`` elsewhere."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "none"


def defaults(profile: str, engine_kv_blocks: int | None, block_size: int | None) -> list[str]:
    if profile == "cpu":
        engine_kv_blocks = engine_kv_blocks or CPU_BLOCKS
        block_size = block_size or CPU_BLOCK_SIZE
    out = ["--block-size", str(block_size)] if block_size else []
    if engine_kv_blocks:
        usable = (engine_kv_blocks - 1) * block_size  # one block is vLLM's null block
        out += [
            "--num-gpu-blocks-override",
            str(engine_kv_blocks),
            "--max-model-len",
            str(usable),
            "--max-num-batched-tokens",
            str(usable),
        ]
    if profile == "cpu":
        out += ["--gpu-memory-utilization", "0.3", "--enforce-eager"]
    return out + ["--seed", "0"]


def _is_flag(token: str) -> bool:
    return token.startswith("-") and not re.fullmatch(r"-[\d.]+(e-?\d+)?", token)


def flag_name(token: str) -> str:
    """The setting a flag sets: ``--no-enforce-eager`` and ``--enforce_eager``
    both set ``enforce-eager``."""
    name = token.lstrip("-").split("=", 1)[0].replace("_", "-")
    return name.removeprefix("no-")


def units(tokens: list[str]) -> list[list[str]]:
    """Tokens grouped as a flag and its values."""
    out: list[list[str]] = []
    for token in tokens:
        if _is_flag(token) or not out:
            out.append([token])
        else:
            out[-1].append(token)
    return out


def merge(default: list[str], given: list[str]) -> list[str]:
    """The defaults whose flag ``given`` does not set, then ``given``."""
    taken = {flag_name(u[0]) for u in units(given) if _is_flag(u[0])}
    kept = [t for u in units(default) if flag_name(u[0]) not in taken for t in u]
    return kept + given


def user_args(args) -> list[str]:
    """``--serve-arg`` values (each split as a shell would) and what came
    after ``--``."""
    return [t for a in args.serve_arg for t in shlex.split(a)] + list(
        getattr(args, "serve_passthrough", [])
    )


def serve_args(args) -> list[str]:
    profile = getattr(args, "serve_defaults", None) or default_profile()
    return merge(defaults(profile, args.engine_kv_blocks, args.block_size), user_args(args))
