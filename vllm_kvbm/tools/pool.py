"""``kvbm-pool``: keeps this machine's pool files, and serves them to peers, while engines restart.

    kvbm-pool --dir /dev/shm --socket /run/kvbm/pool.sock [--serve-port 7300]
              [--serve-host 0.0.0.0] [--max-bytes 64GiB]
              [--directory-url redis://HOST:6379 [--directory-ttl 300]]
    kvbm-pool --check --socket /run/kvbm/pool.sock     # exit 0 when it answers

Engines started with ``pool_socket`` ask it for the pool file of their
namespace, TP rank and page size (tiers/pool/attach.py): it creates the file
in ``--dir`` (or finds it again), holds it mapped, registers it with its NIXL
agent and, with ``--serve-port``, answers peers for it on port + rank; the
engine maps the same file and writes into it. So an engine that crashes or
restarts loses no page, and peers keep reading them meanwhile. At start it
takes up the pool files it finds in ``--dir`` (its own, from before a
restart) and serves them again at once. Files are held until it exits; they
stay in ``--dir`` after it (a memory filesystem: until the machine reboots,
or ``rm``).

Only processes of its own user may attach (``SO_PEERCRED``): the files are
0600. The socket is created 0600 in a directory made 0700.

With ``--directory-url`` (the engines' peer_directory_url; the password from
``--directory-password-file`` or KVBM_REMOTE_PASSWORD) it keeps its
endpoint's liveness key in the peer directory while it serves, and renews
the entries of the rank-0 pool files it holds (tiers/peer/directory.py), so
they stay listed while their engine restarts.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading

from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.config.parsing import parse_size
from vllm_kvbm.tiers.page_format import HEADER_BYTES
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.attach import (
    VERSION,
    AttachRefused,
    ask,
    ping_message,
    recv_message,
    send_message,
)
from vllm_kvbm.tiers.pool.layout import MAX_WAYS, Geometry, Superblock
from vllm_kvbm.tiers.pool.pool_file import PoolFile, PoolSpec, open_pool

logger = logging.getLogger("kvbm-pool")

# A client that sends nothing for this long is dropped (one at a time here).
_CLIENT_TIMEOUT_S = 10.0


class PoolService:
    def __init__(
        self,
        directory: str,
        socket_path: str,
        serve_host: str = "0.0.0.0",
        serve_port: int | None = None,
        max_bytes: int | None = None,
        peer_directory: dict | None = None,
    ):
        self.directory = os.path.abspath(directory)
        if not os.path.isdir(self.directory) or not os.access(self.directory, os.W_OK):
            raise KVBMConfigError(f"--dir: {self.directory!r} is not a writable directory")
        self.socket_path = os.path.abspath(socket_path)
        self.serve_host, self.serve_port, self.max_bytes = serve_host, serve_port, max_bytes
        self.files: dict[str, PoolFile] = {}
        self.server = None
        if serve_port is not None:
            from vllm_kvbm.tiers.peer.server import PeerServer

            self.server = PeerServer(serve_host, serve_port)
        # the peer directory: (link, ttl_s), its liveness and per rank-0 file its writer
        self._directory = None
        self._liveness = None
        self._writers: dict = {}
        try:
            if peer_directory is not None:
                self._open_directory(**peer_directory)
            self._listener = _listen(self.socket_path)
        except BaseException:
            self.close()
            raise

    def _open_directory(
        self,
        url: str,
        password=None,
        ttl_s: float = 300.0,
        tls_ca_file: str | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        from vllm_kvbm.tiers.peer.directory import Liveness, open_link

        if self.server is None:
            raise KVBMConfigError(
                "--directory-url: it lists the pool files served to peers, "
                "and none are: set --serve-port too"
            )
        link = open_link(url, password, timeout_s, "for kvbm-pool", tls_ca_file)
        self._directory = (link, ttl_s)
        self._liveness = Liveness(link, self.endpoint, self.server.incarnation)
        logger.info(
            "kvbm-pool: its liveness and its rank-0 pool files' pages listed in the "
            "peer directory at %s",
            link.target,
        )

    @property
    def endpoint(self) -> str | None:
        """The rank-0 endpoint peers read its files at (None: not served)."""
        if self.server is None:
            return None
        from vllm_kvbm.tiers.peer.protocol import endpoint_of

        return endpoint_of(self.serve_host, self.serve_port)

    # -- files ---------------------------------------------------------------------
    def adopt_existing(self) -> int:
        """Takes up the live pool files in the directory (a restart's)."""
        for name in sorted(os.listdir(self.directory)):
            if not layout.valid_file_name(name) or name in self.files:
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as f:
                    sb = Superblock.unpack(
                        f.read(layout.SUPERBLOCK_BYTES), os.fstat(f.fileno()).st_size
                    )
                if sb is None or sb.state != layout.LIVE:
                    continue
                self._hold(
                    PoolSpec(self.directory, name, sb.name_digest, sb.scope_digest, sb.geometry),
                    create=False,
                )
            except (OSError, KVBMConfigError) as err:
                logger.warning("kvbm-pool: not taking up %s: %s", path, err)
        if self.files:
            logger.info(
                "kvbm-pool: took up %d pool file(s) left in %s", len(self.files), self.directory
            )
        return len(self.files)

    def _hold(self, spec: PoolSpec, create: bool = True) -> PoolFile:
        pool = open_pool(spec, create=create)
        self.files[spec.name] = pool
        if self.server is not None:
            rank = _rank_of(spec.name)
            try:
                self.server.bind(self.serve_port + rank)
                self.server.serve(pool)
            except Exception as err:  # noqa: BLE001 - the file still serves its engines
                logger.warning(
                    "kvbm-pool: cannot serve %s to peers on port %d: %s",
                    spec.path,
                    self.serve_port + rank,
                    err,
                )
            else:
                self._list(pool, rank)
        return pool

    def _list(self, pool: PoolFile, rank: int) -> None:
        """Renews the directory entries of a rank-0 file it serves (its
        engines write them as pages come and go; this keeps them while the
        engines restart)."""
        if self._directory is None or rank != 0:
            return
        from vllm_kvbm.tiers.peer.directory import DirectoryWriter

        link, ttl_s = self._directory
        old = self._writers.pop(pool.name, None)
        if old is not None:
            old.close()
        self._writers[pool.name] = DirectoryWriter(link, pool.name, self.endpoint, ttl_s, pool=pool)

    def attach(self, message: dict, uid: int) -> dict:
        """The reply to one engine's attach request."""
        if uid != os.geteuid():
            return _no(
                f"kvbm-pool runs as uid {os.geteuid()}, the engine as uid {uid}: the "
                f"pool files are 0600, run both as one user"
            )
        if message.get("op") != "attach" or message.get("version") != VERSION:
            return _no(f"an attach request of version {VERSION} expected")
        try:
            spec = self._spec(message)
        except (KeyError, TypeError, ValueError) as err:
            return _no(f"bad attach request: {err}")
        held = self.files.get(spec.name)
        if held is not None:
            sb = held.superblock
            if (
                sb.scope_digest != spec.scope_digest
                or sb.geometry.stored_bytes != spec.geometry.stored_bytes
            ):
                return _no(
                    f"{held.path} holds pages of another KV layout, page size or "
                    f"format (another engine's, still held); give this engine "
                    f"another pool_dir, or restart kvbm-pool once that engine is gone"
                )
            pool = held
        else:
            total = sum(p.size for p in self.files.values()) + spec.geometry.file_bytes
            if self.max_bytes is not None and total > self.max_bytes:
                return _no(
                    f"--max-bytes {self.max_bytes} reached ({total} bytes with this "
                    f"file); give kvbm-pool more, or the engines a smaller "
                    f"pool_cache_size"
                )
            try:
                pool = self._hold(spec)
            except (KVBMConfigError, OSError, TimeoutError) as err:
                return _no(str(err))
        rank = _rank_of(spec.name)
        endpoint = None
        if self.server is not None and pool.name in self.server.served:
            from vllm_kvbm.tiers.peer.protocol import endpoint_of

            endpoint = endpoint_of(self.serve_host, self.serve_port)
        logger.info(
            "kvbm-pool: pid %s attached to %s (rank %d, %d slots)",
            message.get("pid"),
            pool.path,
            rank,
            pool.geometry.nslots,
        )
        return {
            "ok": True,
            "path": pool.path,
            "nslots": pool.geometry.nslots,
            "ways": pool.geometry.ways,
            "endpoint": endpoint,
        }

    def _spec(self, m: dict) -> PoolSpec:
        name = m["name"]
        if not isinstance(name, str) or not layout.valid_file_name(name):
            raise ValueError(f"not a pool file name: {name!r}")
        digest, scope = bytes.fromhex(m["name_digest"]), bytes.fromhex(m["scope_digest"])
        rank, world = _rank_of(name), int(name.rsplit("of", 1)[1])
        if len(digest) != 16 or len(scope) != 32 or layout.file_name(digest, rank, world) != name:
            raise ValueError("digests that do not name this file")
        g = Geometry(int(m["stored_bytes"]), int(m["nslots"]), int(m["ways"]))
        if (
            not 0 < g.ways <= MAX_WAYS
            or g.nslots < g.ways
            or g.nslots % g.ways
            or g.stored_bytes <= HEADER_BYTES
        ):
            raise ValueError("a geometry that is not a pool's")
        return PoolSpec(self.directory, name, digest, scope, g)

    # -- the socket ------------------------------------------------------------------
    def serve_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not select.select([self._listener], [], [], 0.5)[0]:
                continue
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_CLIENT_TIMEOUT_S)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            message = recv_message(conn)
            if message.get("op") == "ping":
                reply = {"ok": True, "files": len(self.files)}
            else:
                reply = self.attach(message, uid)
            if not reply.get("ok"):
                logger.warning(
                    "kvbm-pool: refused pid %s: %s", message.get("pid"), reply.get("error")
                )
            send_message(conn, reply)
        except (OSError, ValueError, ConnectionError) as err:
            logger.warning("kvbm-pool: a client: %s", err)

    def close(self) -> None:
        listener = getattr(self, "_listener", None)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
                os.unlink(self.socket_path)
        if self._liveness is not None:
            self._liveness.close()  # peers stop counting its entries at once
            self._liveness = None
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        if self._directory is not None:
            self._directory[0].close()
            self._directory = None
        if self.server is not None:
            self.server.close()
        for pool in self.files.values():
            pool.close()
        self.files.clear()


def _no(error: str) -> dict:
    return {"ok": False, "error": error}


def _rank_of(name: str) -> int:
    return int(name.rsplit("-r", 1)[1].split("of")[0])


def _listen(path: str) -> socket.socket:
    """The Unix socket at ``path``, 0600 in a directory made 0700; refuses
    when another kvbm-pool answers there, replaces a dead one's."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if os.path.exists(path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(2.0)
            try:
                probe.connect(path)
                raise KVBMConfigError(f"--socket: another kvbm-pool listens on {path}")
            except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
                os.unlink(path)  # a dead one's
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(16)
    return sock


def _directory_args(args) -> dict | None:
    """The peer directory's settings from the command line; KVBMConfigError
    naming the option and the fix."""
    if args.directory_url is None:
        for name in ("directory_password_file", "directory_tls_ca_file"):
            if getattr(args, name) is not None:
                raise KVBMConfigError(f"--{name.replace('_', '-')} needs --directory-url")
        return None
    from vllm_kvbm.config import MIN_DIRECTORY_TTL_S
    from vllm_kvbm.config.secrets import Secret, parse_password_file
    from vllm_kvbm.config.urls import check_directory_url, parse_ca_file

    url = check_directory_url("--directory-url", args.directory_url)
    if not args.directory_ttl >= MIN_DIRECTORY_TTL_S:
        raise KVBMConfigError(
            f"--directory-ttl: at least {MIN_DIRECTORY_TTL_S:g} seconds "
            f"(entries are renewed every third of it), e.g. 300"
        )
    env = os.environ.get("KVBM_REMOTE_PASSWORD", "")
    if args.directory_password_file is not None and env.strip():
        raise KVBMConfigError(
            "KVBM_REMOTE_PASSWORD and --directory-password-file are both set; set only one of them"
        )
    password = (
        parse_password_file("--directory-password-file", args.directory_password_file)
        if args.directory_password_file is not None
        else Secret(env.rstrip("\r\n"), "KVBM_REMOTE_PASSWORD")
        if env.strip()
        else None
    )
    ca = (
        parse_ca_file("--directory-tls-ca-file", args.directory_tls_ca_file)
        if args.directory_tls_ca_file is not None
        else None
    )
    return {"url": url, "password": password, "ttl_s": args.directory_ttl, "tls_ca_file": ca}


def check(socket_path: str, timeout_s: float = 5.0) -> int:
    """0 when the kvbm-pool at ``socket_path`` answers (a healthcheck), else 1."""
    try:
        reply = ask(socket_path, ping_message(), timeout_s)
        print(f"kvbm-pool at {socket_path}: {reply.get('files')} pool file(s)")
        return 0 if reply.get("ok") else 1
    except (OSError, AttachRefused) as err:
        print(f"kvbm-pool at {socket_path}: {err}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvbm-pool", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dir",
        default="/dev/shm",
        help="where the pool files are (a memory filesystem); the engines' pool_dir",
    )
    p.add_argument(
        "--socket", required=True, help="the Unix socket engines attach on (their pool_socket)"
    )
    p.add_argument(
        "--serve-port",
        type=int,
        default=None,
        help="serve the pool files to peers: TP rank r's on this port + r",
    )
    p.add_argument("--serve-host", default="0.0.0.0", help="address to serve peers on")
    p.add_argument(
        "--max-bytes",
        default=None,
        help="most bytes of pool files to hold, e.g. 64GiB (default: no cap)",
    )
    p.add_argument(
        "--directory-url",
        default=None,
        help="the peer directory (the engines' peer_directory_url, redis://HOST:PORT): "
        "keep this process's liveness there and renew its files' entries",
    )
    p.add_argument(
        "--directory-ttl",
        type=float,
        default=300.0,
        help="seconds a directory entry lives (the engines' peer_directory_ttl_s)",
    )
    p.add_argument(
        "--directory-password-file",
        default=None,
        help="a file holding the directory's password (or KVBM_REMOTE_PASSWORD)",
    )
    p.add_argument(
        "--directory-tls-ca-file",
        default=None,
        help="CA certificates (PEM) a rediss:// directory's certificate chains to",
    )
    p.add_argument("--check", action="store_true", help="ask a running kvbm-pool and exit")
    args = p.parse_args(argv)
    if args.check:
        return check(args.socket)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        max_bytes = None if args.max_bytes is None else parse_size("--max-bytes", args.max_bytes)
        service = PoolService(
            args.dir,
            args.socket,
            args.serve_host,
            args.serve_port,
            max_bytes,
            _directory_args(args),
        )
    except KVBMConfigError as err:
        print(f"kvbm-pool: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        service.adopt_existing()
        logger.info(
            "kvbm-pool: pool files in %s; engines attach on %s%s",
            service.directory,
            service.socket_path,
            f"; peers served on {args.serve_host}:{args.serve_port}+rank"
            if args.serve_port is not None
            else "",
        )
        service.serve_forever(stop)
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
