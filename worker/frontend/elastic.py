"""``rm.elastic``: training that goes on when hosts are lost and grows when hosts are added.

Horovod's ``hvd.elastic`` names: :class:`State`, :class:`ObjectState`, :class:`TorchState`,
:func:`run`, :class:`ElasticSampler`, :class:`HostsUpdatedInterrupt` and
``HorovodInternalError`` (the error whose arrival ends a generation). Launch with
``ringrun -np N --min-np A --max-np B [--host-discovery-script S] python train.py``;
docs/elastic.md has the whole story.
"""
# ruff: noqa: F401 - this module re-exports rm.elastic's names

from ringmaster.worker.frontend.elastic_run import run
from ringmaster.worker.frontend.elastic_sampler import ElasticSampler
from ringmaster.worker.frontend.elastic_state import HostsUpdatedInterrupt, ObjectState, State, TorchState
from ringmaster.worker.runtime.errors import HorovodInternalError

__all__ = ["State", "ObjectState", "TorchState", "run", "ElasticSampler", "HostsUpdatedInterrupt",
           "HorovodInternalError"]
