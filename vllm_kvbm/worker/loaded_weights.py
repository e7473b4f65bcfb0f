"""The weights this worker runs, as the label the keys name them by.

Keys name the model's files as loaded (fingerprints.py). vLLM can change the
weights in memory afterwards, and always does it through ``collective_rpc``
on the worker, which KVBM watches where vLLM dispatches it
(weight_changes.py). A worker's label is one of:

- ``""``: the files as loaded (the namespace's keys);
- ``load:<digest>``: what identified updates loaded since (``reload_weights``,
  vLLM's weight-transfer API), digested from the (name, tensor) pairs handed
  to the model's ``load_weights`` and chained on the label before, so engines
  that received the same updates share pages again; a ``reload_weights`` of
  the very files loaded at startup (same paths and stats, nothing else
  changed since) gives ``""`` back;
- ``private:<random>``: a change KVBM cannot identify (a function sent
  through ``collective_rpc``, an unknown method, a failed update), or the
  weights while a change is under way: this engine's pages alone.

A change moves the worker to a fresh private label at once, before it runs:
the next step's worker metadata reports it (the scheduler's keys follow), and
jobs keyed under another label are refused meanwhile (a store not cached, a
load recomputed). The label stays private until vLLM's prefix cache is
reset, because until then vLLM's own cache serves KV of the weights before,
and pages computed on top of it are this engine's only. The reset starts a
weights epoch (scheduler/weights_epochs.py); on it the worker takes the
label the change earned (an identified load's, else a new private one),
checks its parameters' digest against the last one (weights changed with no
call seen, e.g. in the engine's own process: a new private label) and
reports.

vLLM's sleep mode (sleep_mode.py): a level-1 sleep keeps the label (the
same bytes come back); a level-2 sleep drops the weights, so the label turns
private at once and follows only an identified load that writes every
parameter dropped (``dropped``). A digest pass running on a thread stops
before the weights' memory goes and runs again once it is back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any, Callable

from vllm_kvbm.cpus import widened_thread
from vllm_kvbm import opened_files
from vllm_kvbm.worker import sleep_mode, weight_changes
from vllm_kvbm.worker.weight_digests import DigestStopped, LoadDigest, weights_bytes, weights_digest

logger = logging.getLogger(__name__)

# A pass over at most this many bytes of weights runs inline, on vLLM's
# worker thread, when the epoch starts (tens of milliseconds to a few hundred
# at the CPU rates of docs/benchmarks.md); a larger model's runs on a thread
# of its own, its jobs refused meanwhile.
INLINE_DIGEST_BYTES = 256 << 20


def private_label() -> str:
    return "private:" + os.urandom(16).hex()


def _caller_self(match: Callable[[Any], bool]) -> Any:
    """The ``self`` of the nearest caller (within 24 frames) that ``match``
    accepts: the connector gets no reference to vLLM's model or worker, but
    vLLM registers the KV cache from methods of both. None when none does."""
    frame = sys._getframe(2)
    for _ in range(24):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and match(owner):
            return owner
        frame = frame.f_back
    return None


def find_model_runner() -> Any:
    """vLLM's model runner (anything with ``get_model``)."""
    return _caller_self(lambda owner: callable(getattr(owner, "get_model", None)))


def _find_worker() -> Any:
    """vLLM's worker object (the one ``collective_rpc`` calls)."""
    return _caller_self(lambda owner: hasattr(owner, "model_runner") and hasattr(owner, "rank"))


class LoadedWeights:
    """This worker's weights: their label, the changes vLLM makes to them,
    each weights epoch the scheduler starts, and whether jobs keyed under
    given labels may run (``serves``)."""

    def __init__(self, rank: int, model: Callable[[], Any] | None):
        self.rank = rank
        self._model = model  # returns the model vLLM runs now
        self._lock = threading.Lock()
        self.epoch = 0
        self.label = ""  # of the weights as they run now
        self._next: str | None = None  # the label a change earned, from the next epoch
        self._changes = 0  # changes seen begin or end
        # (changes, parameters' digest) when last checked; None: not taken
        self._basis: tuple[int, str | None] = (0, None)
        self._checking = False  # this epoch's digest pass is running
        self._tainted = False  # a change not identified since load
        self._blind = False  # vLLM's calls cannot be seen: a new private label per epoch
        self._touched: set[str] = set()  # names loaded by updates since the files' label
        self._files: opened_files.Selection | None = None  # the files vLLM loaded
        self.session: Any = None  # a weight-transfer update under way (weight_changes.py)
        self._unreported: list[tuple[int, int, str]] = []
        self._refusing_logged: tuple[int, str] | None = None
        self._warned = False
        # Weights vLLM dropped (level-2 sleep): the label they had, and the
        # parameters a load must write for the label to follow what it loaded.
        self._dropped: tuple[str, frozenset[str] | None] | None = None
        # This epoch's digest pass on a thread: (thread, its stop event, epoch).
        self._pass: tuple[threading.Thread, threading.Event, int] | None = None
        self._rerun: int | None = None  # the epoch of a pass stopped by sleep
        self.follows_sleep = False  # the worker's sleep mode calls are wrapped (sleep_mode.py)

    @classmethod
    def from_vllm(cls, rank: int, kv: Any = None) -> "LoadedWeights":
        """Called while vLLM registers the KV cache: its model runner, worker
        and collective_rpc dispatch are found on the stack. Without the
        model, each new epoch gets a random label (pages stored before a
        prefix-cache reset are then never looked up again by this engine);
        without the dispatch, every label is private. ``kv``: the KVBMWorker,
        whose KV release and restore run around the worker's sleep mode
        calls (sleep_mode.py)."""
        runner = find_model_runner()
        weights = cls(rank, runner.get_model if runner is not None else None)
        try:
            if runner is not None:
                weights.digest_at_load()
        except Exception as err:  # a model whose tensors cannot be read as bytes
            logger.warning("KVBM: cannot digest the model's parameters (%s)", err)
            runner = weights._model = None
        if runner is None:
            logger.warning(
                "KVBM: without the model's parameters, each reset of vLLM's "
                "prefix cache moves this engine's keys to a new epoch (pages are "
                "not shared across a reset)"
            )
        worker = _find_worker()
        model = getattr(
            getattr(getattr(worker, "vllm_config", None), "model_config", None), "model", None
        )
        weights._files = opened_files.latest(model) if model else None
        followed = (
            sleep_mode.follow(weights, worker, kv)
            if worker is not None and kv is not None
            else frozenset()
        )
        weights.follows_sleep = "sleep" in followed
        if weight_changes.watch(weights, worker, followed) is None:
            logger.warning(
                "KVBM: cannot see the calls vLLM's executor runs on this worker "
                "(collective_rpc), so not whether they change the weights: this "
                "engine's pages are its own (shared with no other engine), and "
                "each reset of vLLM's prefix cache starts a new label"
            )
            weights.blind()
        return weights

    def blind(self) -> None:
        """No change can be seen: a private label from now on, a new one at
        every epoch."""
        with self._lock:
            self._blind = self._tainted = True
            self.label = private_label()
            self._unreported.append((self.epoch, self.rank, self.label))

    def digest_at_load(self) -> None:
        self._basis = (self._changes, weights_digest(self._model()))

    # ---- changes, as vLLM makes them (weight_changes.py) ---------------------------

    def begin_change(self, what: str) -> str:
        """vLLM starts changing the weights: a fresh private label at once.
        Returns the label the weights had, which an identified load chains on."""
        with self._lock:
            base = self._next if self._next is not None else self.label
            if self._dropped is not None:  # what a load after a level-2 sleep chains on
                base = self._dropped[0]
            self._changes += 1
            self.label = private_label()
            self._unreported.append((self.epoch, self.rank, self.label))
            if self.session is not None:
                self.session.ok = False  # something else changed them mid-update
        return base

    def end_change(
        self,
        label: str | None,
        what: str,
        loaded: set[str] = frozenset(),
        params: set[str] | None = None,
    ) -> None:
        """The change is over: ``label`` is the weights' label from the next
        epoch on (None: one KVBM cannot identify: a new private label).
        ``params``: the parameters the load wrote (None: not known); after a
        level-2 sleep the label holds only if they are all it dropped."""
        with self._lock:
            self._changes += 1
            if self._dropped is not None:
                need = self._dropped[1]
                if label is not None and (need is None or params is None or not need <= params):
                    label = None  # some dropped parameters hold what the memory had
                self._dropped = None
            if label is None:
                label, self._tainted = private_label(), True
            self._touched = set() if label == "" else self._touched | set(loaded)
            self._next = label
            # announced for the next epoch: its first step's keys name it
            self._unreported.append((self.epoch + 1, self.rank, label))
        if label.startswith("private:"):
            # once as a warning: an RL loop may send such a change every step
            log = logger.info if self._warned else logger.warning
            self._warned = True
            log(
                "KVBM: %s changed the weights in a way KVBM cannot identify: this engine's "
                "pages are its own from now on (until a restart)",
                what,
            )
        else:
            logger.info(
                "KVBM: %s loaded %s: from the next reset of vLLM's prefix cache on, "
                "pages are keyed by them (until then, this engine's own)",
                what,
                "the weights' files as loaded" if not label else "other weights",
            )

    def dropped(self, params: frozenset[str] | None, what: str) -> None:
        """vLLM drops the weights' memory (level-2 sleep, ``discard``): a
        private label at once, and for good unless the first change after is
        an identified load of every parameter in ``params`` (the ones dropped;
        None: not known): then the label of what it loaded, chained on the
        label they had."""
        base = self.begin_change(what)
        with self._lock:
            if self._dropped is None:
                self._dropped = (base, params)
            self._next = None  # what an earlier change earned is gone with them
            self._unreported.append((self.epoch + 1, self.rank, self.label))

    def suspend_checks(self) -> None:
        """Before vLLM releases the weights' memory (sleep): a digest pass
        reading the parameters on a thread stops first; ``resume_checks``
        runs it again once they are back (its epoch's jobs wait for it)."""
        running, self._pass = self._pass, None
        if running is None:
            return
        thread, stop, epoch = running
        stop.set()
        thread.join()
        with self._lock:
            if self._checking and self.epoch == epoch:
                self._rerun = epoch

    def resume_checks(self) -> None:
        """The weights' memory is back (wake-up): a pass sleep stopped runs again."""
        epoch, self._rerun = self._rerun, None
        if epoch is not None and epoch == self.epoch:
            self._check(epoch)

    @contextlib.contextmanager
    def unidentified(self, what: str):
        """Around a call that may change the weights in ways KVBM cannot tell."""
        self.begin_change(what)
        try:
            yield
        finally:
            self.end_change(None, what)

    def load_label(
        self, base: str, digest: LoadDigest, selections: list[opened_files.Selection]
    ) -> str | None:
        """The label of the weights after a load of ``digest`` on weights
        labelled ``base``: "" for a reload of exactly the files loaded at
        startup (``selections``: the files it read) when only identified
        loads of names it covers happened since; None when the pairs could
        not all be digested, or none passed."""
        if not digest or digest.failed:
            return None
        if self._reloads_the_files(digest, selections):
            return ""
        import blake3

        return "load:" + blake3.blake3(f"{base}|{digest.hexdigest()}".encode()).hexdigest()

    def _reloads_the_files(
        self, digest: LoadDigest, selections: list[opened_files.Selection]
    ) -> bool:
        if self._tainted or self._files is None or len(selections) != 1:
            return False
        [read] = selections
        same = {f[1:] for f in read.files} == {f[1:] for f in self._files.files}
        return same and opened_files.moved(read) is None and self._touched <= digest.names

    # ---- epochs, as the scheduler starts them --------------------------------------

    def serves(self, weights: tuple[int, tuple[str, ...]] | None) -> bool:
        """Whether jobs keyed under ``weights`` (the scheduler's epoch and
        per-rank labels) hold KV of the weights this worker runs. A newer
        epoch starts the worker's check of its weights."""
        if weights is None:
            return True  # no job keyed yet
        epoch, labels = weights
        if epoch > self.epoch:
            self._start(epoch)
        with self._lock:
            label = self.label
            ok = (
                epoch == self.epoch
                and not self._checking
                and self.rank < len(labels)
                and labels[self.rank] == label
            )
        if not ok and self._refusing_logged != (epoch, label):
            self._refusing_logged = (epoch, label)
            logger.info(
                "KVBM: weights epoch %d: this worker's weights are not (yet) the ones "
                "the scheduler's keys name; loads and stores refused until they are",
                epoch,
            )
        return ok

    def _start(self, epoch: int) -> None:
        """vLLM's prefix cache was reset: the label a change earned applies,
        and the parameters are checked for changes no call showed."""
        with self._lock:
            self.epoch, self._checking = epoch, True
            if self._next is not None:
                self.label, self._next = self._next, None
            if self._blind:
                self.label = private_label()
        self._check(epoch)

    def _check(self, epoch: int) -> None:
        """The epoch's digest of the parameters (``_checked`` takes it)."""
        with self._lock:
            changes = self._changes
        if self._model is None:
            self._checked(epoch, changes, None)
            return
        model = self._model()
        if weights_bytes(model) <= INLINE_DIGEST_BYTES:
            self._checked(epoch, changes, weights_digest(model))
            return
        stop = threading.Event()

        def run() -> None:
            try:
                digest = weights_digest(model, stop=stop)
            except DigestStopped:
                return  # sleep stopped it: resume_checks runs it again
            self._checked(epoch, changes, digest)

        thread = widened_thread(run, "kvbm-weights-digest")  # hashing: not the forward's core
        self._pass = (thread, stop, epoch)
        thread.start()

    def _checked(self, epoch: int, changes: int, digest: str | None) -> None:
        unseen = False
        with self._lock:
            if epoch != self.epoch:
                return  # a newer epoch started meanwhile: its pass reports
            if digest is None:  # the parameters cannot be read: a label per epoch
                self.label = "unseen:" + os.urandom(16).hex()
            elif changes != self._changes:
                self._basis = (-1, None)  # changed while read: the next pass takes it
            elif self._basis[0] != changes or self._basis[1] is None:
                self._basis = (changes, digest)  # the first check since a change seen
            elif self._basis[1] != digest:
                unseen = True  # changed with no call seen: nothing says how
                self._changes += 1
                self._basis = (self._changes, digest)
                self.label, self._tainted = private_label(), True
            self._checking = False
            self._unreported.append((epoch, self.rank, self.label))
        if unseen:
            logger.warning(
                "KVBM: the model's parameters changed without a call KVBM saw "
                "(not through collective_rpc): this engine's pages are its own "
                "from now on (until a restart)"
            )

    def take_unreported(self) -> list[tuple[int, int, str]]:
        """(epoch, rank, label) of each label this worker took since the last
        call (a change, an epoch's check), and of the label a change earned
        for the next epoch (epoch + 1)."""
        with self._lock:
            taken, self._unreported = self._unreported, []
        return taken
