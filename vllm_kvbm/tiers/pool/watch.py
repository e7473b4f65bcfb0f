"""An attached worker's watch on kvbm-pool: said when it stops answering and
when it is back.

The pool file stays mapped in the engine when kvbm-pool exits, so the
engine's own hits go on (its host tier is that file); what stops is the
pool's service to peers and its renewal of the file's directory entries.
Nothing on vLLM's threads notices, so a thread of the watch's own asks the
pool every WATCH_EVERY_S (a ping, bounded by WATCH_TIMEOUT_S): one warning
when it stops answering, and once it answers again the worker attaches
again (the pool holds the same file, whether or not it took it up at its
start: asking twice is harmless) and says so in one line.
"""

from __future__ import annotations

import logging
import threading

from vllm_kvbm.cpus import widened_thread
from vllm_kvbm.tiers.pool.attach import AttachRefused, ask, ask_attach, ping_message
from vllm_kvbm.tiers.pool.pool_file import PoolSpec

logger = logging.getLogger(__name__)

WATCH_EVERY_S = 5.0
WATCH_TIMEOUT_S = 5.0


class PoolWatch:
    """Asks kvbm-pool at ``socket_path`` whether it answers, on a thread of
    its own until close()."""

    def __init__(self, socket_path: str, spec: PoolSpec, rank: int):
        self.socket_path, self.spec, self.rank = socket_path, spec, rank
        self.answering = True
        self.lost = 0  # times it stopped answering
        self._stop = threading.Event()
        self._thread = widened_thread(self._run, "kvbm-pool-watch")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            self.check()

    def check(self) -> bool:
        """Whether kvbm-pool answers (attached again when it was lost)."""
        try:
            if self.answering:
                if not ask(self.socket_path, ping_message(), WATCH_TIMEOUT_S).get("ok"):
                    raise AttachRefused("it answered no")
            else:
                ask_attach(self.socket_path, self.spec, self.rank, WATCH_TIMEOUT_S)
        except (OSError, AttachRefused) as err:
            if self.answering:
                self.answering = False
                self.lost += 1
                logger.warning(
                    "KVBM: pool tier: kvbm-pool at %s stopped answering (%s); this engine "
                    "keeps its pages in %s and hits them, peers cannot read them until "
                    "kvbm-pool is back (asked every %g s)",
                    self.socket_path,
                    err,
                    self.spec.path,
                    WATCH_EVERY_S,
                )
            return False
        if not self.answering:
            self.answering = True
            logger.info(
                "KVBM: pool tier: kvbm-pool at %s answers again and holds %s; it serves "
                "this engine's pages to peers again",
                self.socket_path,
                self.spec.path,
            )
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)  # a check in progress ends on its own
