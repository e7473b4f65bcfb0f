"""Serving pool files to peers: a NIXL agent and a control endpoint.

Whoever holds a pool file (a worker keeping its own, or the kvbm-pool
process) registers its whole mapping with one NIXL agent (UCX) and answers
``hello`` and ``lookup`` (protocol.py) on a ZMQ ROUTER socket at
``tcp://HOST:PORT`` (``PORT + r`` for TP rank r). A peer then reads pages
with one-sided NIXL READs (store.py) straight from the mapping: this process
does nothing per page; its thread only lets UCX's worker run (TCP's READ
needs it) and answers the control requests.

One thread does everything NIXL and ZMQ here (NIXL's agent is created
without thread safety): ``serve``, ``withdraw`` and ``bind`` hand it a
command and wait. The agent's metadata goes in the ``hello`` reply, so a peer
needs no NIXL listener port: the control port (and UCX's own) is all a
firewall opens. A peer of another scope (another model, page size, KV layout
or format) is refused, logged once per file and scope.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

from vllm_kvbm.cpus import run_widened, widened_thread
from vllm_kvbm.tiers.peer import protocol
from vllm_kvbm.tiers.peer.agent import NixlCallError, PeerAgent
from vllm_kvbm.tiers.pool import layout

logger = logging.getLogger(__name__)

# How often the serving thread lets UCX progress when no request comes: a
# peer's TCP READ waits for this at most per round trip.
PROGRESS_INTERVAL_S = 0.001
# Keys one lookup may ask about.
MAX_LOOKUP_KEYS = 4096


@dataclass
class _Served:
    pool: object  # PoolFile
    reg: object
    scope_hex: str


class PeerServer:
    """Serves pool files on ``tcp://host:port`` (and more ports: ``bind``)."""

    def __init__(self, host: str, port: int, progress_interval_s: float = PROGRESS_INTERVAL_S):
        import zmq

        self._zmq = zmq
        self.host = host
        self.incarnation = uuid.uuid4().hex
        # UCX's and ZMQ's own threads start here: not on the caller's one core
        self._agent, self._ctx, self._sock = run_widened(self._open, host, port)
        self.ports = [port]
        self._files: dict[str, _Served] = {}
        self._metadata = self._agent.metadata()
        self._metadata_version = 0
        self._refused: set[tuple[str, str]] = set()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._interval_ms = max(1, int(progress_interval_s * 1000))
        self._stop = threading.Event()
        # not vLLM's worker thread's one core: peers' TCP READs wait on its progress loop
        self._thread = widened_thread(self._run, "kvbm-peer-server")
        self._thread.start()

    def _open(self, host: str, port: int):
        zmq = self._zmq
        agent = PeerAgent("kvbm-pool-server")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            sock.close()
            ctx.term()
            raise
        return agent, ctx, sock

    @property
    def endpoint(self) -> str:
        """The rank-0 endpoint peers name (this machine's host name for a wildcard bind)."""
        return protocol.endpoint_of(self.host, self.ports[0])

    @property
    def served(self) -> set[str]:
        """Names of the pool files it answers for."""
        return set(self._files)

    # -- commands, run on the serving thread -----------------------------------
    def serve(self, pool, timeout_s: float = 60.0) -> None:
        """Registers ``pool``'s mapping and answers for its file from now on."""
        self._command(("serve", pool), timeout_s)

    def withdraw(self, name: str, timeout_s: float = 60.0) -> None:
        """Stops serving the file ``name``; its mapping is deregistered."""
        self._command(("withdraw", name), timeout_s)

    def bind(self, port: int, timeout_s: float = 10.0) -> None:
        """Answers on ``port`` too (the kvbm-pool process: a port per TP rank)."""
        if port not in self.ports:
            self._command(("bind", port), timeout_s)
            self.ports.append(port)

    def _command(self, command: tuple, timeout_s: float):
        if self._stop.is_set():
            raise RuntimeError("peer server closed")
        done: Future = Future()
        self._commands.put((command, done))
        return done.result(timeout=timeout_s)

    def _do(self, command: tuple):
        what, arg = command
        if what == "serve":
            name = arg.name
            if name in self._files:
                self._drop(name)
            reg = self._agent.register(arg.addr, arg.size)
            self._files[name] = _Served(arg, reg, arg.superblock.scope_digest.hex())
            self._refresh_metadata()
            logger.info(
                "KVBM: serving pool file %s to peers at %s (%.2f GiB registered with NIXL)",
                arg.path,
                self.endpoint,
                arg.size / 1024**3,
            )
        elif what == "withdraw":
            self._drop(arg)
            self._refresh_metadata()
        elif what == "bind":
            self._sock.bind(f"tcp://{self.host}:{arg}")

    def _drop(self, name: str) -> None:
        served = self._files.pop(name, None)
        if served is not None:
            self._agent.deregister(served.reg)

    def _refresh_metadata(self) -> None:
        # A peer's loaded metadata names the registrations it knew: a new
        # version makes it load the agent again (store.py).
        self._metadata = self._agent.metadata()
        self._metadata_version += 1

    # -- the serving loop -------------------------------------------------------
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(self._interval_ms))
                self._agent.progress()
                while not self._commands.empty():
                    command, done = self._commands.get()
                    try:
                        done.set_result(self._do(command))
                    except Exception as err:  # noqa: BLE001 - handed to the caller
                        done.set_exception(err)
                if self._sock in ready:
                    self._reply(self._sock.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError as err:
                if self._stop.is_set():
                    break
                logger.warning("KVBM: peer server: %s", err)
            except NixlCallError as err:
                logger.warning("KVBM: peer server: %s", err)
            except Exception as err:  # noqa: BLE001 - the thread must go on serving
                logger.exception("KVBM: peer server: %s", err)
        for name in list(self._files):
            self._drop(name)

    def _reply(self, frames: list[bytes]) -> None:
        # [identity, b"", request...] from a DEALER that sends an empty delimiter
        if len(frames) < 3 or frames[1] != b"":
            return
        message: dict = {}
        try:
            message, _ = protocol.decode(frames[2:])
            answer, blob = self._answer(message)
        except (ValueError, KeyError, TypeError) as err:
            answer, blob = {"ok": False, "error": f"bad request: {err}"}, None
        answer["id"] = message.get("id")
        self._sock.send_multipart(
            [frames[0], b""] + protocol.encode(answer, blob), self._zmq.NOBLOCK
        )

    def _answer(self, message: dict) -> tuple[dict, bytes | None]:
        op, name, scope = message.get("op"), message.get("file"), message.get("scope")
        served = self._files.get(name) if isinstance(name, str) else None
        if served is None:
            return {"ok": False, "error": f"no pool file {name!r} served here"}, None
        # A lookup may leave the scope out: a scheduler knows no KV layout, and
        # whoever reaches this endpoint can READ the table anyway. A hello,
        # which reads pages next, must name it.
        if scope != served.scope_hex and not (op == "lookup" and scope is None):
            if (name, str(scope)) not in self._refused:
                self._refused.add((name, str(scope)))
                logger.warning(
                    "KVBM: peer server: refused a peer whose pages do not match "
                    "%s (another model, page size, KV layout or format; said once "
                    "per file and scope)",
                    name,
                )
            return {
                "ok": False,
                "error": "scope mismatch: the peer's pages do not verify "
                "against this engine's (another model, page size, "
                "KV layout or format)",
            }, None
        pool = served.pool
        if op == "hello":
            g = pool.geometry
            known = message.get("known")
            fresh = known != [self.incarnation, self._metadata_version]
            return {
                "ok": True,
                "agent": self._agent.name,
                "incarnation": self.incarnation,
                "metadata_version": self._metadata_version,
                "base": pool.addr,
                "length": pool.size,
                "stored_bytes": g.stored_bytes,
                "nslots": g.nslots,
                "ways": g.ways,
                "table_off": g.table_off,
                "data_off": g.data_off,
                "stride": g.stride,
                "file_incarnation": pool.superblock.incarnation.hex(),
            }, (self._metadata if fresh else None)
        if op == "lookup":
            keys = message["keys"]
            if not isinstance(keys, list) or len(keys) > MAX_LOOKUP_KEYS:
                return {"ok": False, "error": f"keys: a list of at most {MAX_LOOKUP_KEYS}"}, None
            found = [
                layout.find(pool.view, pool.geometry, bytes.fromhex(k)) is not None for k in keys
            ]
            return {"ok": True, "found": found}, None
        return {"ok": False, "error": f"unknown op {op!r}"}, None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops answering, deregisters every file; the files stay (their owner's)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._sock.close()
        self._ctx.term()
        self._agent.close()
