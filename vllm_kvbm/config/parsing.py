"""Parsers of single values (sizes, integers, booleans, directories, seconds,
ports, hosts, choices): each takes the key it reads, for its messages."""

from __future__ import annotations

import math
import os
import re
from typing import Any

from vllm_kvbm.config.errors import KVBMConfigError

# Units of a size, as vLLM's human-readable sizes (--kv-cache-memory-bytes,
# vllm.utils.argparse_utils.human_readable_int) read them: an upper-case
# K/M/G/T is binary (16G = 16 GiB, what --kv-offloading-size 16 and LMCache's
# max_local_cpu_size 16 mean), a lower-case one decimal (16g = 16e9 bytes).
# Ki/KiB... are binary and KB/MB/GB/TB decimal in any case.
_LETTER_UNITS = {
    "K": 1024,
    "M": 1024**2,
    "G": 1024**3,
    "T": 1024**4,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
}
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
SIZE_EXAMPLES = (
    '"16GiB", "16Gi" or "16G" (16 x 1024^3 bytes, as vLLM\'s '
    '--kv-offloading-size 16), "16GB" or "16g" (16 x 10^9 bytes), '
    '"512MiB" or a number of bytes'
)


def _unit_bytes(unit: str) -> int | None:
    if unit in _LETTER_UNITS:
        return _LETTER_UNITS[unit]
    return _UNITS.get(unit.lower())


def parse_size(key: str, value: Any) -> int:
    """Parses "16GiB", "16Gi", "16G" (binary), "16GB", "16g" (decimal), "1.5 GiB"
    or a plain byte count into bytes."""
    if isinstance(value, bool):
        raise KVBMConfigError(
            f"{key}: expected a size, got {value!r}; write it like {SIZE_EXAMPLES}"
        )
    if isinstance(value, int):
        number, unit = value, ""  # exact: float() would round counts past 2**53
    elif isinstance(value, float):
        number, unit = value, ""
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        number, unit = float(m.group(1)), m.group(2)
    else:
        raise KVBMConfigError(
            f"{key}: cannot read {value!r} as a size; write it like {SIZE_EXAMPLES}"
        )
    scale = _unit_bytes(unit)
    if scale is None:
        raise KVBMConfigError(
            f"{key}: unknown unit {unit!r} in {value!r}; write it like {SIZE_EXAMPLES} "
            f"(Ki, Mi, Gi, Ti, KiB... and K, M, G, T are 1024-based; KB, MB, GB, TB and "
            f"k, m, g, t are 1000-based)"
        )
    if not math.isfinite(number):
        raise KVBMConfigError(f"{key}: size must be a finite number of bytes, got {value!r}")
    if number < 0:
        raise KVBMConfigError(f"{key}: size must not be negative, got {value!r}")
    if not unit and 0 < number < MIN_UNITLESS_BYTES:
        # vLLM's --kv-offloading-size 16 and LMCache's max_local_cpu_size: 16 mean
        # GiB; read as bytes, 16 would start an engine whose tier holds nothing.
        shown = f"{number:g}"
        raise KVBMConfigError(
            f"{key}: {value!r} has no unit, so it reads as {shown} bytes, less than 1 MiB; "
            f'write the unit: "{shown}GiB" (what vLLM\'s --kv-offloading-size {shown} and '
            f"LMCache's max_local_cpu_size: {shown} mean), or a byte count of at least {MIN_UNITLESS_BYTES}"
        )
    return int(number * scale)


# A size without a unit below this is refused (see parse_size).
MIN_UNITLESS_BYTES = 1 << 20


def parse_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise KVBMConfigError(f"{key}: expected an integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise KVBMConfigError(f"{key}: expected an integer, got {value!r}") from None
    if number < minimum:
        raise KVBMConfigError(f"{key}: must be >= {minimum}, got {number}")
    return number


def parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise KVBMConfigError(f"{key}: expected true or false, got {value!r}")


def parse_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise KVBMConfigError(f"{key}: expected a string, got {value!r}")
    return value


def parse_dir(key: str, value: Any) -> str:
    path = parse_str(key, value)
    if not os.path.isdir(path):
        raise KVBMConfigError(
            f"{key}: directory {path!r} does not exist; create it (mkdir -p {path}) "
            f"or set {key} to an existing directory"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise KVBMConfigError(
            f"{key}: directory {path!r} is not writable by this process; fix its "
            f"permissions or set {key} to a writable directory"
        )
    return os.path.abspath(path)


def parse_socket_path(key: str, value: Any) -> str:
    """A Unix socket's path (it need not exist yet: the process serving it
    may start later); made absolute."""
    path = parse_str(key, value).strip()
    if not path or "\0" in path:
        raise KVBMConfigError(f"{key}: expected the path of a Unix socket, got {value!r}")
    return os.path.abspath(os.path.expanduser(path))


def parse_seconds(key: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise KVBMConfigError(f"{key}: expected a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise KVBMConfigError(f"{key}: must be a positive number of seconds, got {value!r}")
    return seconds


def parse_port(key: str, value: Any) -> int:
    port = parse_int(key, value, 1)
    if port > 65535:
        raise KVBMConfigError(f"{key}: {port} is not a TCP port; use 1..65535")
    return port


def parse_host(key: str, value: Any) -> str:
    host = parse_str(key, value)
    if not host or any(c.isspace() for c in host):
        raise KVBMConfigError(
            f'{key}: {host!r} is not a host name or address; use "0.0.0.0" (every '
            f'interface) or "127.0.0.1" (this machine only)'
        )
    return host


def parse_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    text = str(value).upper() if isinstance(value, str) else value
    if text not in choices:
        raise KVBMConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")
    return text


# NIXL backends that move host memory to and from files or object stores.
_NIXL_STORAGE_BACKENDS = ("POSIX", "GDS", "GDS_MT", "OBJ", "HF3FS", "AZURE_BLOB", "GUSLI")


def parse_nixl_backend(key: str, value: Any) -> str:
    """The backend of the one NIXL agent that copies pages between the engine's
    KV cache and the host tier, to itself: device <-> host memory on CUDA
    (VRAM <-> DRAM), host <-> host on CPU. UCX does that; nothing else is tested."""
    if not isinstance(value, str):
        raise KVBMConfigError(f'{key}: expected a string such as "UCX", got {value!r}')
    name = value.strip().upper()
    if name == "UCX":
        return name
    if name in _NIXL_STORAGE_BACKENDS:
        raise KVBMConfigError(
            f"{key}: {value!r} is a NIXL storage backend (host memory <-> files or "
            f"objects); it cannot copy the engine's KV blocks between device memory and "
            f'the host tier. Set {key} to "UCX" (the default) or remove it; the disk '
            f"tier is set with disk_cache_dir"
        )
    raise KVBMConfigError(
        f"{key}: {value!r} is not a NIXL backend that copies between the engine's KV "
        f'memory and host RAM; set {key} to "UCX" (the default) or remove it'
    )
