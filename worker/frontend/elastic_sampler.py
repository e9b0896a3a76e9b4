"""``rm.elastic.ElasticSampler``: shards a dataset over the current ranks, and re-shards what
is left of the epoch when the job re-forms (Horovod's ``hvd.elastic.ElasticSampler``).

Algorithm: the sampler keeps the set of indices processed in this epoch (each rank records
its own batches with :meth:`ElasticSampler.record_batch` or :meth:`~ElasticSampler.record_indices`;
``TorchState.save()`` gathers them from every rank). :meth:`~ElasticSampler.reset` takes the
epoch's indices that are not processed (in the epoch's order: shuffled with ``seed + epoch``
when ``shuffle``), pads them with their own first entries to a multiple of the number of
ranks (as ``DistributedSampler`` and Horovod do, so every rank runs as many batches), and
gives rank ``r`` every ``size``-th entry from ``r``. So across a re-form no example is
repeated or skipped; within an epoch's last round up to ``size - 1`` examples are used twice.
"""

from __future__ import annotations

import math
import random
from typing import Dict, Iterable, Iterator, List, Set

import torch.utils.data

from ringmaster.worker.frontend import functions, topology


class ElasticSampler(torch.utils.data.Sampler):
    """Sampler over ``dataset`` (anything with ``len``) for elastic jobs.

    Args:
        dataset: the dataset (only its length is used).
        shuffle: shuffle each epoch's order (deterministically: ``seed + epoch``).
        seed: the shuffle's seed; every rank must give the same.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: Set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: List[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark this rank's batch number ``batch_idx`` (counted from the start of the current
        iteration, i.e. since the last re-form) of ``batch_size`` samples as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark dataset ``indices`` as processed by this rank."""
        self.processed_indices.update(int(index) for index in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """This rank's dataset indices of batch ``batch_idx`` of the current iteration."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def gather_processed(self) -> None:
        """Union the processed indices of every rank (collective; needs ``rm.init()``)."""
        if _initialized() and topology.size() > 1:
            for part in functions.allgather_object(sorted(self.processed_indices)):
                self.processed_indices.update(part)

    def state_dict(self) -> Dict[str, object]:
        """``epoch`` and ``processed_indices`` (a set)."""
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: Dict[str, object]) -> None:
        """Take ``state_dict`` (from :meth:`state_dict`) and re-shard."""
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def _epoch_order(self) -> List[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def reset(self) -> None:
        """Re-shard the epoch's unprocessed indices over the current ranks."""
        self.num_replicas = topology.size() if _initialized() else 1
        self.rank = topology.rank() if _initialized() else 0
        self.remaining_indices = [index for index in self._epoch_order() if index not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._shard()

    def _shard(self) -> List[int]:
        indices = list(self.remaining_indices)
        if indices and len(indices) < self.total_size:
            padding = self.total_size - len(indices)
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        self.indices = self._shard()
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _initialized() -> bool:
    return topology.is_initialized()
