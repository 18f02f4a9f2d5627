"""Tensor parallelism's process groups and collectives: what the models read (`tp_rank`,
`tp_size`) and call (`all_reduce`, `all_gather`), set up by an executor or from torchrun's
environment. Without `init_distributed` the process is rank 0 of 1 and every collective is
the identity, so one device needs no process group."""

from kvfit.distributed.collectives import all_gather, all_gather_object, all_reduce, broadcast
from kvfit.distributed.parallel_state import (
    DistributedInit,
    destroy_distributed,
    init_distributed,
    init_from_env,
    is_initialized,
    tp_rank,
    tp_size,
)

__all__ = [
    "DistributedInit",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "broadcast",
    "destroy_distributed",
    "init_distributed",
    "init_from_env",
    "is_initialized",
    "tp_rank",
    "tp_size",
]
