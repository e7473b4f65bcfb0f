"""The scheduler's lookups in the tiers below host RAM, off vLLM's scheduler thread.

The stores themselves run in the workers; the scheduler only asks whether a
page exists, by its name, without LMCache, through each medium's view
(``tiers/<medium>/view.py``: the disk through the directory, an LMCache
server through the ``lm://`` EXIST message, Redis/Valkey through EXISTS),
opened by ``tiers/registry.py``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kvbm.cpus import widened_thread
from vllm_kvbm.keys import PageKey
from vllm_kvbm.scheduler.tier_policy import LowerTiers, PeerTarget
from vllm_kvbm.tiers.registry import open_peer_view, open_views

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)


class BackgroundLookups:
    """Lower-tier lookups that may wait on a server, run on a thread of their
    own so that vLLM's scheduler thread never does.

    One question per request at a time: ``ask`` returns the answer once it is
    known, else None after queueing the question (the planner then answers
    vLLM "ask again next step"). An answer keeps serving the request while
    its lookup starts inside the run asked about (blocks before it meanwhile
    stored to the host tier by others, say), so a moving start never asks
    again; answers are dropped when the request is admitted or finished
    (``forget``). An answer older than ``REFRESH_S`` still serves (the
    request is never held back for it) while it is asked again, so a request
    that waits long for room sees pages written since (or gone). Nothing is
    copied per step: a question's keys are copied when it is queued.

    The same thread answers the write-through's question which reused pages
    the disk has already (``check_disk``, answers taken by ``take_checked``):
    a stat on a hung network filesystem blocks this thread, not vLLM's.

    A question is ``overdue`` while the thread is stuck in a call into a
    tier (``LowerTiers.calls``: far longer than such calls usually take);
    the planner then lets its request go on early (``_waited_enough``).
    """

    def __init__(self, lower: LowerTiers):
        self._lower = lower
        self._lock = threading.Lock()
        self._entries: dict[str, _Question] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._checked: list[tuple[list[PageKey], set[PageKey]]] = []
        self.checks_pending = 0  # disk checks queued or being answered
        # (start, first key) -> (keys asked, run, answered at) of answers that
        # came after their request went on (``went_on``), newest last
        self._late: dict[
            tuple[int, PageKey], tuple[list[PageKey], list[str], float, str | None]
        ] = {}
        # not the engine thread's one core (cpus.py)
        self._thread = widened_thread(self._serve, "kvbm-lookup")
        self._thread.start()

    def ask(
        self, req_id: str, keys: list[PageKey], start: int, end: int, peer: str | None = None
    ) -> tuple[list[str], int] | None:
        """The lower tiers of the longest run held of ``keys[start:end]``, as
        (run, offset): block ``start + k`` is in tier ``run[offset + k]`` for
        ``offset + k < len(run)``. None: asked, not answered yet. ``peer``:
        the control endpoint of the peer the request's hint names (its pool
        is asked after the tiers of this machine)."""
        got = self.ask_at(req_id, keys, start, end, peer)
        return None if got is None else (got[0], got[1])

    def ask_at(
        self, req_id: str, keys: list[PageKey], start: int, end: int, peer: str | None = None
    ) -> tuple[list[str], int, str | None] | None:
        """``ask``'s (run, offset) and the endpoint of the peer its "peer"
        pages are at: the hint's, or without one the peer the directory
        named (None: the run names no peer page)."""
        with self._lock:
            q = self._entries.get(req_id)
            if (
                q is not None
                and q.start <= start < q.start + q.count
                and keys[q.start] == q.first  # same chain: same blocks
                and q.peer == peer
                # an answer whose run ends before ``start`` says nothing of it
                and (q.run is None or start - q.start <= len(q.run))
            ):
                if q.run is None:
                    return None
                if not q.asking and time.monotonic() - q.answered_at > REFRESH_S:
                    q.asking = True
                    self._queue.put((req_id, q, keys[q.start : q.start + q.count]))
                return q.run, start - q.start, q.found_peer
            q = self._entries[req_id] = _Question(start, keys[start], end - start, peer=peer)
            # (an answer that named a peer's pages is the hinted request's own)
            late = self._late_answer(keys, start, end) if peer is None else None
            if late is not None:
                # Another request went on without this answer: it serves at
                # once, and is asked again (it is old) at the next ask.
                q.run, q.answered_at, q.found_peer = late
                q.asking = False
                return q.run, 0, q.found_peer
        self._queue.put((req_id, q, keys[start:end]))
        return None

    def ask_each(
        self, req_id: str, keys: list[PageKey], peer: str | None = None
    ) -> list[str | None] | None:
        """The first lower tier holding each of ``keys`` (None: none does),
        for a hybrid model's group pages (scheduler/group_pages.py); None:
        asked, not answered yet. The question is ``req_id``'s second one,
        forgotten with it."""
        got = self.ask_each_at(req_id, keys, peer)
        return None if got is None else got[0]

    def ask_each_at(
        self, req_id: str, keys: list[PageKey], peer: str | None = None
    ) -> tuple[list[str | None], str | None] | None:
        """``ask_each``'s answer and the endpoint of the peer its "peer"
        pages are at (as ``ask_at``)."""
        qid, first = req_id + _EACH, hashlib.sha256(b"".join(keys)).digest()
        with self._lock:
            q = self._entries.get(qid)
            if q is not None and q.first == first and q.peer == peer:
                return None if q.run is None else (q.run, q.found_peer)  # type: ignore
            q = self._entries[qid] = _Question(0, first, len(keys), each=True, peer=peer)
        self._queue.put((qid, q, list(keys)))
        return None

    def overdue(self, req_id: str) -> bool:
        """Whether the request's question is unanswered while the thread is
        stuck in a call into a tier (a frozen server, a hung mount): the
        answer then comes, if at all, at that tier's timeout."""
        with self._lock:
            q = self._entries.get(req_id)
            waiting = q is not None and q.run is None
        return waiting and self._lower.calls.stuck()

    def went_on(self, req_id: str) -> None:
        """The request went on without its answer (it waited as long as the
        answer could save): the answer, when it comes, serves later requests
        with the same pages (``_late_answer``)."""
        with self._lock:
            q = self._entries.get(req_id)
            if q is not None:
                q.abandoned = True

    def _late_answer(
        self, keys: list[PageKey], start: int, end: int
    ) -> tuple[list[str], float, str | None] | None:
        """A recent answer to a question some request went on without, if it
        asked about the same pages: the same start page (so the same prefix)
        and the same keys as far as its run and the page after it."""
        hit = self._late.get((start, keys[start]))
        if hit is None:
            return None
        asked, run, answered_at, found_peer = hit
        if time.monotonic() - answered_at > LATE_ANSWER_S:
            del self._late[(start, keys[start])]
            return None
        m = min(len(run) + 1, len(asked), end - start)
        if keys[start : start + m] != asked[:m]:
            return None
        return run, answered_at, found_peer

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._entries.pop(req_id, None)
            self._entries.pop(req_id + _EACH, None)

    def check_disk(self, ask: list[PageKey], keys: list[PageKey]) -> None:
        """Asks which of ``ask`` the disk holds; ``take_checked`` then returns
        ``keys`` with that set."""
        with self._lock:
            self.checks_pending += 1
        self._queue.put((None, list(ask), list(keys)))

    def take_checked(self) -> list[tuple[list[PageKey], set[PageKey]]]:
        with self._lock:
            done, self._checked = self._checked, []
        return done

    def _check(self, ask: list[PageKey], keys: list[PageKey]) -> None:
        try:
            on_disk = self._lower.on_disk(ask)
        except Exception as err:  # a view must not kill the thread: written again
            logger.warning("KVBM: disk check failed: %s", err)
            on_disk = set()
        with self._lock:
            self._checked.append((keys, on_disk))
            self.checks_pending -= 1

    def _serve(self) -> None:
        while True:
            req_id, q, keys = self._queue.get()
            if req_id is None:
                self._check(q, keys)
                continue
            with self._lock:
                if self._entries.get(req_id) is not q:
                    continue  # forgotten or asked again meanwhile
            target = PeerTarget(q.peer)  # the directory may name one (no hint)
            try:
                run = (
                    self._lower.find_each(keys, target)
                    if q.each
                    else self._lower.find_run_doubling(keys, target)
                )
            except Exception as err:  # a view must not kill the thread: a miss
                logger.warning("KVBM: lower-tier lookup failed: %s", err)
                run = []
            # the peer a load reads this answer's peer pages from
            found = target.endpoint if "peer" in (run or ()) else None
            with self._lock:
                q.run, q.answered_at, q.asking = run, time.monotonic(), False
                q.found_peer = found
                if q.abandoned and q.peer is None:
                    self._late.pop((q.start, q.first), None)
                    self._late[(q.start, q.first)] = (keys, run, q.answered_at, found)
                    while len(self._late) > LATE_ANSWERS:
                        del self._late[next(iter(self._late))]


# An answer this old is asked again (and serves until the new one is in).
REFRESH_S = 0.5
# An answer that came after its request went on serves requests asking about
# the same pages this long, at most LATE_ANSWERS such answers at a time.
LATE_ANSWER_S = 10.0
LATE_ANSWERS = 64


@dataclass
class _Question:
    start: int
    first: PageKey
    count: int
    run: list[str] | None = None  # None: not answered yet
    answered_at: float = 0.0
    asking: bool = True  # queued or being answered
    abandoned: bool = False  # its request went on without it
    each: bool = False  # ask_each's: a tier or None per key, not a run
    peer: str | None = None  # the hinted peer's control endpoint, asked last
    found_peer: str | None = None  # the peer its run's "peer" pages are at


# ask_each's question id: the request's id and this
_EACH = "\0groups"


def lower_tiers(config: "KVBMConfig", info: "EngineInfo") -> LowerTiers:
    """The scheduler's views of the configured pool, disk and remote tiers,
    and of peers' pools (tiers/registry.py)."""
    return LowerTiers(
        open_views(config, info),
        config.disk_admission,
        config.disk_admission_min_uses,
        peer_view=open_peer_view(config, info),
    )
