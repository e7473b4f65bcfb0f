"""Which weights the scheduler's keys name, epoch by epoch.

The workers run the weights; the scheduler only keys pages. At startup the
keys name the model's files as loaded (identity.py). vLLM may change the
weights in memory afterwards, and RL frameworks reset vLLM's prefix cache
after every such sync: each successful reset starts a new weights epoch
here, which every step's connector metadata carries. Each worker then
digests the parameters it runs and reports a label per TP rank ("": the
weights as loaded; else their digest; worker/loaded_weights.py). Once all
ranks reported, the keys derive from those labels: engines that received the
same update agree, and weights back to what was loaded find their old pages.

Meanwhile jobs are keyed under the labels known so far; a worker whose
weights differ from those refuses them (a load is recomputed, a store not
cached), so a page of the old weights is never onboarded, and nothing waits.
"""

from __future__ import annotations

import logging

from vllm_kvbm.keys import derive_seed

logger = logging.getLogger(__name__)


class WeightsEpochs:
    def __init__(self, num_workers: int):
        self.epoch = 0
        self.labels: tuple[str, ...] = ("",) * num_workers
        self._reports: dict[int, str] = {}  # rank -> label, of this epoch
        self._sent = True  # the workers were told of this epoch (meta)

    def seed(self, base: bytes) -> bytes:
        """The key seed: ``base`` (the namespace's) for the weights as
        loaded, else derived from the labels."""
        if not any(self.labels):
            return base
        return derive_seed(base, "weights", *self.labels)

    def new_epoch(self) -> None:
        """vLLM's prefix cache was reset: the workers digest their weights
        again. Once per reset, however many hooks see it: an epoch no worker
        was told of yet is the new one already."""
        if not self._sent:
            return
        self.epoch += 1
        self._reports = {}
        self._sent = False

    def meta(self) -> tuple[int, tuple[str, ...]]:
        """What the connector metadata carries: the epoch, and the labels
        the keys of its jobs name."""
        return self.epoch, self.labels

    def reported(self, digests: list[tuple[int, int, str]]) -> bool:
        """Takes the workers' (epoch, rank, label) reports; True when the
        labels of the current epoch are all in and differ from the keys'
        (the caller derives the keys anew)."""
        for epoch, rank, label in digests:
            if epoch == self.epoch and 0 <= rank < len(self.labels):
                self._reports[rank] = label
                self._sent = True  # a worker answered it: it was told
        if len(self._reports) < len(self.labels):
            return False
        labels = tuple(self._reports[rank] for rank in range(len(self.labels)))
        self._reports = {}
        if labels == self.labels:
            return False
        self.labels = labels
        logger.info("KVBM: weights epoch %d: %s", self.epoch,
                    "the weights are as loaded again" if not any(labels) else
                    "the weights differ from those loaded; keys now name their digest")
        return True
