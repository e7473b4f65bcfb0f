"""Run by scripts/wheel_smoke.sh inside the fresh venv, from outside the
repository: the installed wheel imports, registers the plugin name, and an
engine configured by that name alone takes a step and offloads."""

from __future__ import annotations

import sys
import sysconfig
from importlib.metadata import distribution, entry_points, requires
from pathlib import Path


def lock_pins() -> dict:
    """canonical name -> version the lock pins (KVBM_SMOKE_LOCK; none: {})."""
    import os

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    path = os.environ.get("KVBM_SMOKE_LOCK", "none")
    if path == "none":
        return {}
    lines = [line.split("#")[0].strip() for line in open(path)]
    reqs = [Requirement(line) for line in lines if line]
    return {canonicalize_name(r.name): next(iter(r.specifier)).version for r in reqs}


def check_declared_deps() -> None:
    """Every requirement of the wheel (and its [cpu] extra) is installed at a
    version it allows: what `pip check` would say for this one package; and at
    the version the lock pins, where setup.sh installed through one."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = lock_pins()
    problems = []
    for line in requires("vllm-kvbm") or []:
        req = Requirement(line)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in ("", "cpu")):
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            problems.append(f"{req} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req} (installed {have})")
        pin = pins.get(canonicalize_name(req.name))
        if pin is not None and Version(have) != Version(pin):
            problems.append(f"{req.name} {have} (the lock pins =={pin})")
    if problems:
        sys.exit("wheel smoke: unmet requirements of vllm-kvbm: " + "; ".join(problems))


def main(model: str) -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    import vllm_kvbm

    where = Path(vllm_kvbm.__file__).resolve()
    assert site in where.parents, f"vllm_kvbm imported from {where}, not the wheel in {site}"
    dist = distribution("vllm-kvbm")
    assert Path(dist._path).resolve().parent == site, dist._path  # the wheel's metadata
    check_declared_deps()

    [ep] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvbm"]
    assert ep.value == "vllm_kvbm.plugin:register", ep
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="KVBMConnector", kv_role="kv_both")
    )
    assert (
        cls.__module__ == "vllm_kvbm.connector"
        and site in Path(sys.modules[cls.__module__].__file__).resolve().parents
    )

    from prometheus_client import REGISTRY
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_kvbm.tools.compute_dtype import compute_dtype

    llm = LLM(
        model=model,
        dtype=compute_dtype(),
        kv_transfer_config={"kv_connector": "KVBMConnector", "kv_role": "kv_both"},
        max_model_len=1024,
        block_size=128,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        gpu_memory_utilization=0.25,
        disable_log_stats=False,
        seed=0,
    )
    [out] = llm.generate(
        TokensPrompt(prompt_token_ids=list(range(10, 410))),
        SamplingParams(max_tokens=4, temperature=0.0),
    )
    assert len(out.outputs[0].token_ids) == 4, out
    offloaded = sum(
        s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name == "kvbm_offload_blocks_total"
    )
    llm.llm_engine.engine_core.shutdown()
    assert offloaded >= 3, f"kvbm_offload_blocks_total = {offloaded}, expected 3 blocks"
    print(
        f"wheel smoke: vllm_kvbm {dist.version} from {where.parent}; plugin name resolves; "
        f"one generate offloaded {offloaded:.0f} blocks"
    )


if __name__ == "__main__":
    main(sys.argv[1])
