"""The peer tier's NIXL agents (UCX), with every NIXL call wrapped.

NIXL raises from almost every call (``nixlRemoteDisconnectError`` from
``check_xfer_state``, ``transfer`` and ``send_notif`` once the peer died,
``nixlNotFoundError`` and ``nixlBackendError`` from ``prep_xfer_dlist``,
``add_remote_agent``, ``create_backend``): ``PeerAgent.call`` turns any of
them into a ``NixlCallError`` that says whether the peer is gone, and callers
catch that one type.

No progress thread: NIXL's spins a whole core (measured 0.9 of one here,
idle). The serving side progresses its UCX worker from its own loop every
millisecond or so (peer/server.py: about 2% of a core); the reading side
progresses it while it polls its transfers. UCX's transport is UCX's choice
(``UCX_TLS`` in the environment, read when the agent is created): on one
machine it copies through the kernel (cma, synchronously inside
``transfer``), across machines over TCP or RDMA. UCX_TCP_TX_SEG_SIZE is
set to 64 KiB unless the environment sets it (below).
"""

from __future__ import annotations

import logging
import os
import uuid

logger = logging.getLogger(__name__)

TCP_TX_SEG_SIZE = "64kb"


class NixlCallError(Exception):
    """A NIXL call failed; ``disconnected``: NIXL says the peer is gone."""

    def __init__(self, message: str, disconnected: bool = False):
        super().__init__(message)
        self.disconnected = disconnected


def _disconnected(err: BaseException) -> bool:
    return type(err).__name__ == "nixlRemoteDisconnectError"


class PeerAgent:
    """One NIXL agent with a UCX backend, named ``<role>-<uuid>`` (a name is
    never reused: a restarted peer is another agent)."""

    def __init__(self, role: str):
        # vLLM does this before it imports NIXL (distributed/nixl_utils.py):
        # UCX's registration cache otherwise grows without bound.
        os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
        # Over TCP UCX emulates a READ: the holder sends the bytes back in
        # segments of its TX size, 8 KiB by default (about 1 GB/s on one
        # machine); 64 KiB, UCX's default RX segment, is what every peer
        # left at UCX's defaults can receive (a larger one crashes it).
        os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", TCP_TX_SEG_SIZE)
        from vllm_kvbm.nixl_api import _nixl_api

        nixl_agent, nixl_agent_config, self.module = _nixl_api()
        self.name = f"{role}-{uuid.uuid4().hex[:16]}"
        try:
            self.agent = nixl_agent(
                self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            )
        except Exception as err:  # noqa: BLE001 - say what failed, not a binding's name
            raise NixlCallError(f"NIXL agent with UCX: {type(err).__name__}: {err}") from None
        if "UCX" not in self.agent.backends:
            raise NixlCallError("NIXL's UCX plugin is not available in this installation")

    def call(self, what: str, fn, *args, **kwargs):
        """``self.agent.<fn>(*args)``; any failure as NixlCallError."""
        try:
            return getattr(self.agent, fn)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - every NIXL call raises its own types
            raise NixlCallError(
                f"{what}: {type(err).__name__}: {err}", _disconnected(err)
            ) from None

    def register(self, addr: int, length: int):
        """``length`` bytes of host memory at ``addr``, for transfers."""
        return self.call(
            "register_memory", "register_memory", [(addr, length, 0, "")], mem_type="DRAM"
        )

    def deregister(self, reg) -> None:
        try:
            self.agent.deregister_memory(reg)
        except Exception as err:  # noqa: BLE001 - at teardown: say it, go on
            logger.warning("KVBM: peer tier: deregister_memory failed: %s", err)

    def descs(self, spans: list[tuple[int, int]]):
        """Transfer descriptors of host memory spans (address, length)."""
        return self.call(
            "get_xfer_descs", "get_xfer_descs", [(addr, n, 0) for addr, n in spans], "DRAM"
        )

    def metadata(self) -> bytes:
        return self.call("get_agent_metadata", "get_agent_metadata")

    def progress(self) -> None:
        """Lets UCX's worker run (a peer's READ of our memory needs it under
        TCP); notifications are not used by the peer tier."""
        self.call("progress", "get_new_notifs")

    def close(self) -> None:
        """Nothing to release beyond what its owner deregistered; the agent's
        own resources go with the object."""
        self.agent = None
