"""Which NIXL build this process can load: one wheel per CUDA major, matched
to the CUDA runtime PyTorch uses (the two cannot share a process).

Used by the worker's page mover (worker/page_mover.py) and by the peer tier's
agents (tiers/peer/), in the worker and in the kvbm-pool process; never by the
scheduler process."""

from __future__ import annotations

import importlib
import sys

import torch


class NixlBuildError(ImportError):
    """No importable NIXL build matches this process's CUDA runtime."""


_NIXL_BUILDS = ("nixl_cu12", "nixl_cu13")


def nixl_builds_for(cuda_version: str | None, hip_version: str | None = None) -> list[str]:
    """NIXL packages that can serve PyTorch built for ``cuda_version``, in order.

    NIXL ships one wheel per CUDA major (nixl-cu12, nixl-cu13) and they cannot
    share a process (both register the same native types), so the build must
    match the CUDA runtime PyTorch uses; a CPU build of PyTorch can use any.
    """
    if cuda_version:
        return [f"nixl_cu{cuda_version.split('.')[0]}"]
    if hip_version:
        return ["nixl_rocm"]
    return list(_NIXL_BUILDS)


def _pip_name(module: str) -> str:
    return module.replace("_", "-")


def _nixl_api():
    """(nixl_agent, nixl_agent_config, module name) of the NIXL build that
    matches this process's PyTorch."""
    return load_nixl(torch.version.cuda, getattr(torch.version, "hip", None))


def load_nixl(cuda_version: str | None, hip_version: str | None = None):
    """(nixl_agent, nixl_agent_config, module name) of the NIXL build for
    PyTorch built with ``cuda_version`` (or ROCm ``hip_version``; neither: CPU)."""
    wanted = nixl_builds_for(cuda_version, hip_version)
    runtime = (
        f"PyTorch {torch.__version__} (CUDA {cuda_version})"
        if cuda_version
        else f"PyTorch {torch.__version__} (ROCm {hip_version})"
        if hip_version
        else f"PyTorch {torch.__version__} (CPU)"
    )
    loaded = [m for m in (*_NIXL_BUILDS, "nixl_rocm") if m in sys.modules]
    if loaded and loaded[0] not in wanted:
        raise NixlBuildError(
            f"KVBM: {runtime} needs NIXL's {wanted[0]} build, but {loaded[0]} is already "
            f"loaded in this process and the two cannot coexist; make the process use "
            f"{wanted[0]} (pip install {_pip_name(wanted[0])}; pip uninstall "
            f"{_pip_name(loaded[0])})"
        )
    # A build another component already loaded comes first: a second one
    # cannot be imported beside it.
    for name in loaded + [m for m in wanted if m not in loaded]:
        try:
            api = importlib.import_module(f"{name}._api")
        except ModuleNotFoundError as err:
            if err.name in (name, f"{name}._api"):
                continue
            raise
        return api.nixl_agent, api.nixl_agent_config, name
    raise NixlBuildError(
        f"KVBM: {runtime} needs NIXL's {' or '.join(wanted)} build, which is not "
        f"installed; install it: pip install nixl (the meta package: every CUDA "
        f"major's build), or pip install {_pip_name(wanted[0])}"
    )
