"""Which weights the scheduler's keys name, epoch by epoch.

The workers run the weights; the scheduler only keys pages. At startup the
keys name the model's files as loaded (identity.py). vLLM may change the
weights in memory afterwards. Each worker labels the weights it runs ("":
the files as loaded; a digest of what a weight update loaded; a random
private label after a change it cannot identify; worker/loaded_weights.py)
and reports its label whenever it changes, at once, without waiting for a
reset. Each successful reset of vLLM's prefix cache starts a new weights
epoch here, which every step's connector metadata carries: the workers then
take the labels their weights get once vLLM's cache is clear, check them
against a digest of their parameters and report them. A worker announces
the label a change earned for the next epoch as soon as the change is over,
so the keys of the first step after the reset name it already. Once every
rank reported in an epoch, the keys derive from the latest label of each rank:
engines that received the same update agree, and weights back to what was
loaded find their old pages.

Meanwhile jobs are keyed under the labels known so far; a worker whose
weights differ from those refuses them (a load is recomputed, a store not
cached), so a page of other weights is never onboarded, and nothing waits.
"""

from __future__ import annotations

import logging

from vllm_kvbm.keys import derive_seed

logger = logging.getLogger(__name__)


class WeightsEpochs:
    def __init__(self, num_workers: int):
        self.epoch = 0
        self.labels: tuple[str, ...] = ("",) * num_workers
        # rank -> its latest label in this epoch (epoch 0 starts as loaded)
        self._reports: dict[int, str] = dict(enumerate(self.labels))
        # rank -> the label a change earned it from the next epoch on
        self._next: dict[int, str] = {}
        self._sent = True  # the workers were told of this epoch (meta)

    def seed(self, base: bytes) -> bytes:
        """The key seed: ``base`` (the namespace's) for the weights as
        loaded, else derived from the labels."""
        if not any(self.labels):
            return base
        return derive_seed(base, "weights", *self.labels)

    def new_epoch(self) -> bool:
        """vLLM's prefix cache was reset: the workers label their weights
        again. Once per reset, however many hooks see it: an epoch no step's
        metadata carried yet is the new one already. One that a step carried
        is over: a second reset while the workers still digest (a large
        model's pass runs on a thread) starts another, whose digest is taken
        after it. True when the labels changed (the labels the workers
        announced for it: the caller derives the keys anew)."""
        if not self._sent:
            return False
        self.epoch += 1
        self._reports, self._next = self._next, {}
        self._sent = False
        return self._take()

    @property
    def settled(self) -> bool:
        """Every rank reported in this epoch and none announced a change
        since: the keys name the weights the workers run, so a load keyed
        now is not refused for its weights."""
        return len(self._reports) == len(self.labels) and not self._next

    def meta(self) -> tuple[int, tuple[str, ...]]:
        """What the connector metadata carries: the epoch, and the labels
        the keys of its jobs name. The workers learn of the epoch from it."""
        self._sent = True
        return self.epoch, self.labels

    def reported(self, digests: list[tuple[int, int, str]]) -> bool:
        """Takes the workers' (epoch, rank, label) reports; True when every
        rank reported in the current epoch and their latest labels differ
        from the keys' (the caller derives the keys anew). A report for the
        epoch after this one is the label a change earned from the next reset
        on; one of an earlier epoch is stale (that worker reports again)."""
        for epoch, rank, label in digests:
            if not 0 <= rank < len(self.labels):
                continue
            if epoch == self.epoch:
                self._reports[rank] = label
            elif epoch == self.epoch + 1:
                self._next[rank] = label
        return self._take()

    def _take(self) -> bool:
        if len(self._reports) < len(self.labels):
            return False
        labels = tuple(self._reports[rank] for rank in range(len(self.labels)))
        if labels == self.labels:
            return False
        self.labels = labels
        logger.info(
            "KVBM: weights epoch %d: %s",
            self.epoch,
            "the weights are as loaded again"
            if not any(labels)
            else "the weights differ from those loaded; keys now name them (%s)"
            % ", ".join(sorted({label.split(":")[0] for label in labels if label})),
        )
        return True
