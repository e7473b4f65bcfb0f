"""Dynamo's ``DYN_KVBM_*`` variables: those whose meaning is the same here set
the matching key; the others are named in a warning (docs/configuration.md,
Dynamo's variables)."""

from __future__ import annotations

from typing import Mapping

from vllm_kvbm.config.errors import KVBMConfigError
from vllm_kvbm.config.parsing import parse_bool

# Dynamo serves its KVBM metrics only with DYN_KVBM_METRICS=true, on
# DYN_KVBM_METRICS_PORT or this port (see apply_dyn_metrics).
DYN_KVBM_METRICS_DEFAULT_PORT = 6880


def _dyn_disk_filter(text: str) -> str:
    """Dynamo's disk offload filter (on by default there) writes a block to disk
    on its second use: our "frequency" admission with its default 2 uses."""
    try:
        disabled = parse_bool("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", text)
    except KVBMConfigError:
        raise KVBMConfigError(
            f"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER (sets disk_admission): expected true "
            f'(disk_admission "always") or false ("frequency"), got {text!r}'
        ) from None
    return "always" if disabled else "frequency"


# env var -> (extra_config key, converter of the env text into that key's value)
DYN_ENV = {
    "DYN_KVBM_CPU_CACHE_GB": ("host_cache_size", lambda v: f"{v}GB"),
    "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": ("host_cache_blocks", str),
    "DYN_KVBM_DISK_CACHE_DIR": ("disk_cache_dir", str),
    "DYN_KVBM_DISK_CACHE_GB": ("disk_cache_size", lambda v: f"{v}GB"),
    "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": ("disk_admission", _dyn_disk_filter),
    "DYN_KVBM_METRICS_PORT": ("metrics_port", str),
}


def apply_dyn_metrics(environ: Mapping[str, str], given: dict) -> None:
    """DYN_KVBM_METRICS=true turns the metrics port on (DYN_KVBM_METRICS_PORT, or
    6880 as in Dynamo, unless another source set one); false drops the port
    DYN_KVBM_METRICS_PORT set, as Dynamo would not serve it. ``given``: key ->
    [(source, value)], as load_config gathers them."""
    text = environ.get("DYN_KVBM_METRICS", "").strip()
    if not text:
        return
    try:
        enabled = parse_bool("DYN_KVBM_METRICS", text)
    except KVBMConfigError:
        raise KVBMConfigError(
            f"DYN_KVBM_METRICS (turns metrics_port on): expected true or false, got "
            f"{text!r}; set it to true and DYN_KVBM_METRICS_PORT (default "
            f"{DYN_KVBM_METRICS_DEFAULT_PORT}) to serve the kvbm_* metrics on a port"
        ) from None
    ports = given.get("metrics_port", [])
    if enabled and not ports:
        given["metrics_port"] = [("DYN_KVBM_METRICS", DYN_KVBM_METRICS_DEFAULT_PORT)]
    elif not enabled:
        kept = [(source, port) for source, port in ports if source != "DYN_KVBM_METRICS_PORT"]
        if kept:
            given["metrics_port"] = kept
        else:
            given.pop("metrics_port", None)


def dynamo_env_not_read(environ: Mapping[str, str]) -> list[str]:
    """DYN_KVBM_* variables that are set but mean nothing in KVBM (docs/configuration.md)."""
    return sorted(
        name
        for name, value in environ.items()
        if name.startswith("DYN_KVBM_")
        and name not in DYN_ENV
        and name != "DYN_KVBM_METRICS"
        and value.strip()
    )
