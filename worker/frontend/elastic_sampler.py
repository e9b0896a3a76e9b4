"""``rm.elastic.ElasticSampler``: shards a dataset over the current ranks, and re-shards what
is left of the epoch when the job re-forms (Horovod's ``hvd.elastic.ElasticSampler``).

Algorithm (Horovod's): the epoch's order is ``range(len(dataset))``, shuffled with
``random.Random(seed + epoch)`` when ``shuffle`` (Horovod's order, so a Horovod checkpoint's
count means the same samples here). The state is two numbers, the same on every rank:
``epoch`` and ``processed_num``, how many samples of that order the job has trained on.
:meth:`~ElasticSampler.record_batch` adds ``batch_size × num_replicas`` (every rank trains
one batch of its shard at each step). :meth:`~ElasticSampler.reset` takes the order's
``remaining_indices = order[processed_num:]``, pads them with their own first entries to a
multiple of the number of ranks (as ``DistributedSampler`` and Horovod do, so every rank runs
as many batches), and gives rank ``r`` every ``num_replicas``-th entry from ``r``. Since rank
``r``'s batch ``k`` holds ``remaining[(k·b + i)·n + r]``, the first ``k`` batches of all
``n`` ranks are exactly ``remaining[:k·b·n]``: after ``k`` recorded steps, ``processed_num``
is the length of a prefix of the order that the job has trained on and nothing else. So a
re-form at a commit, at any new size, resumes with the rest of the epoch: no sample is lost
or seen twice, except the up to ``num_replicas - 1`` samples the padding repeats in a
generation's last round (and the last batch of an epoch, when smaller than ``batch_size``,
is counted as a full one: ``processed_num`` may pass ``len(dataset)``, which leaves nothing).

The commit therefore costs nothing per sample: no set of indices, no gathering across ranks.
Checkpoints of ringmaster's earlier sampler (``{"epoch", "processed_indices"}``) are converted
when their indices are a prefix of the epoch's order (they always are when every rank
recorded its batches and ``TorchState`` gathered them), and refused otherwise, with what to
load instead.
"""

from __future__ import annotations

import math
import random
from typing import Dict, Iterator, List, Optional, Tuple

import torch.utils.data

from ringmaster.worker.frontend import topology


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
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: List[int] = []
        self._order_key: Optional[Tuple[int, bool, int, int]] = None
        self._order: List[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` with nothing processed (call it at the end of an epoch, as
        with Horovod, so that a commit in between does not train on the same samples again)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one step's batches as processed: every rank's batch of ``batch_size``, so
        ``processed_num`` grows by ``batch_size × num_replicas`` (``batch_idx`` is not used;
        it is Horovod's signature). Call it on every rank at every step."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> Dict[str, int]:
        """``{"epoch": ..., "processed_num": ...}``, as Horovod's."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: Dict[str, object]) -> None:
        """Take a :meth:`state_dict` (or one of ringmaster's earlier format, converted) and re-shard."""
        if "processed_num" in state_dict:
            epoch, processed_num = int(state_dict["epoch"]), int(state_dict["processed_num"])
        elif "processed_indices" in state_dict:
            epoch = int(state_dict["epoch"])
            processed_num = self._count_old_format(epoch, state_dict["processed_indices"])
        else:
            raise ValueError(f"ElasticSampler.load_state_dict: expected a dict with 'epoch' and 'processed_num' "
                             f"(ElasticSampler.state_dict()), got keys {sorted(map(str, state_dict))}")
        self.epoch = epoch
        self.processed_num = processed_num
        self.reset()

    def reset(self) -> None:
        """Re-shard what is left of the epoch (``order[processed_num:]``) over the current ranks."""
        self.num_replicas = topology.size() if _initialized() else 1
        self.rank = topology.rank() if _initialized() else 0
        self.remaining_indices = self._epoch_order(self.epoch)[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices
        padding = self.total_size - len(indices)
        if padding > 0:  # the start again (more than once only when fewer are left than ranks)
            indices = indices + (indices * math.ceil(padding / len(indices)))[:padding]
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

    def _epoch_order(self, epoch: int) -> List[int]:
        """``range(len(dataset))`` in epoch ``epoch``'s order (kept: a reset after a restore or
        a sync does not shuffle again). Do not modify the list returned."""
        key = (len(self.dataset), bool(self.shuffle), int(self.seed), int(epoch))
        if key != self._order_key:
            order = list(range(key[0]))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._order_key, self._order = key, order
        return self._order

    def _count_old_format(self, epoch: int, processed_indices) -> int:
        """``processed_num`` for ringmaster's earlier state dict: how many indices of epoch
        ``epoch``'s order it holds, which must be the order's first ones."""
        processed = {int(index) for index in processed_indices}
        order = self._epoch_order(epoch)
        prefix = 0
        while prefix < len(order) and order[prefix] in processed:
            prefix += 1
        if prefix == len(processed):
            return prefix
        raise ValueError(
            f"ElasticSampler.load_state_dict: this state dict is in ringmaster's earlier format "
            f"('processed_indices': {len(processed)} indices of epoch {epoch}), and they are not the first "
            f"{len(processed)} samples of epoch {epoch}'s order for this sampler (a dataset of {len(order)}, "
            f"shuffle={self.shuffle}, seed={self.seed}): only the first {prefix} are, so they cannot be counted as "
            f"'processed_num'. Check that the sampler has the dataset, shuffle and seed the checkpoint was written "
            f"with; otherwise load {{'epoch': {epoch}, 'processed_num': {prefix}}} instead (nothing of the epoch is "
            f"lost; the {len(processed) - prefix} processed samples after the first {prefix} are trained on again), "
            f"or {{'epoch': {epoch + 1}, 'processed_num': 0}} to start the next epoch.")


def _initialized() -> bool:
    return topology.is_initialized()
