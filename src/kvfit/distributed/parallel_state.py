"""The process's place in the tensor-parallel group: rank, size, and the groups collectives use.

One group spans every rank (kvfit has tensor parallelism only): the device group (NCCL on CUDA,
gloo on the CPU) carries activations, a gloo group carries small Python objects (answers of the
engine's collective calls under torchrun), so they never touch the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_TIMEOUT = timedelta(minutes=10)  # startup (weights, first kernels) can take minutes per rank


@dataclass(frozen=True)
class DistributedInit:
    """How one rank joins the group: its rank, the world size, the rendezvous address
    (`tcp://host:port` or `env://`) and its device."""

    rank: int
    world_size: int
    init_method: str
    device: torch.device


@dataclass
class _State:
    rank: int = 0
    size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None


_state = _State()


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 without a group)."""
    return _state.rank


def tp_size() -> int:
    """Ranks in the tensor-parallel group (1 without a group)."""
    return _state.size


def is_initialized() -> bool:
    """Whether this process joined a group of more than one rank."""
    return _state.device_group is not None


def device_group() -> dist.ProcessGroup | None:
    return _state.device_group


def cpu_group() -> dist.ProcessGroup | None:
    return _state.cpu_group


def init_distributed(init: DistributedInit) -> None:
    """Join the group `init` describes (NCCL on CUDA, gloo on the CPU); a world of one needs
    no group and creates none."""
    if init.world_size == 1:
        return
    if init.device.type == "cuda":
        torch.cuda.set_device(init.device)
    backend = "nccl" if init.device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init.init_method, rank=init.rank,
                                world_size=init.world_size, timeout=_TIMEOUT,
                                device_id=init.device if backend == "nccl" else None)
    ranks = list(range(init.world_size))
    cpu = dist.new_group(ranks, backend="gloo") if backend == "nccl" else dist.group.WORLD
    _state.rank, _state.size = init.rank, init.world_size
    _state.device_group, _state.cpu_group = dist.group.WORLD, cpu


def init_from_env(tensor_parallel_size: int, device: torch.device) -> DistributedInit:
    """Join the group of a `torchrun` launch (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
    in the environment); each rank takes the device LOCAL_RANK places past `device`'s index.
    Raises `ValueError` when the launch does not match `tensor_parallel_size`."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("distributed_executor_backend='external_launcher' needs a launcher "
                         "such as torchrun to set RANK and WORLD_SIZE; start the script with "
                         "`torchrun --nproc-per-node N` or use the 'mp' backend")
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != tensor_parallel_size:
        raise ValueError(f"torchrun started {world_size} processes but tensor_parallel_size is "
                         f"{tensor_parallel_size}; make them equal")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    init = DistributedInit(int(os.environ["RANK"]), world_size, "env://",
                           rank_device(device, local_rank))
    init_distributed(init)
    return init


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: `rank` places past `device`'s CUDA index (the CPU is shared)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def destroy_distributed() -> None:
    """Leave the group (at worker shutdown), so the process can exit without waiting on it."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.rank, _state.size, _state.device_group, _state.cpu_group = 0, 1, None, None
