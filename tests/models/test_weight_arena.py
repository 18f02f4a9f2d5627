"""`WeightArena` on the host driver: parameters keep their addresses through offload, discard
and restore; buffers stay ordinary tensors; a failed recommit leaves the arena released."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvfit.models.weight_arena import ALIGN, WeightArena
from kvfit.vmm import VmmOutOfMemoryError


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 12)
        self.proj = nn.Linear(12, 7, bias=True)
        self.bf16 = nn.Parameter(torch.randn(3, 5, dtype=torch.bfloat16))  # mixed dtypes share
        self.head = nn.Linear(12, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("table", torch.arange(10.0), persistent=False)


@pytest.fixture
def model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_adoption_moves_every_parameter_into_the_arena_keeping_values_and_ties(model) -> None:
    before, table = _snapshot(model), model.table.data_ptr()
    arena = WeightArena(model, "cpu")
    base = arena.tensor.base_ptr
    for name, p in model.named_parameters():
        assert base <= p.data_ptr() < base + arena.nbytes, name
        assert p.data_ptr() % ALIGN == 0
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
    assert model.head.weight is model.embed.weight
    assert model.table.data_ptr() == table  # buffers are not moved
    assert arena.physical_bytes == arena.tensor.granularity  # rounded up to one granule


def test_offload_and_restore_keep_addresses_and_contents(model) -> None:
    arena = WeightArena(model, "cpu")
    before = _snapshot(model)
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert arena.offload() == arena.nbytes == arena.host_bytes
    assert arena.is_released and arena.physical_bytes == 0
    with pytest.raises(RuntimeError, match="already released"):
        arena.offload()
    assert arena.restore() is True
    assert arena.host_bytes == 0 and not arena.is_released
    for name, p in model.named_parameters():
        assert p.data_ptr() == ptrs[name]
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="resident"):
        arena.restore()


def test_discard_then_restore_gives_zeros_and_forward_still_works(model) -> None:
    arena = WeightArena(model, "cpu")
    arena.discard()
    assert arena.restore() is False
    assert all(not p.any() for p in model.parameters())
    assert torch.equal(model.table, torch.arange(10.0))
    assert not model.proj(torch.ones(2, 12)).any()


def test_failed_recommit_leaves_the_arena_released_with_its_copy(model, monkeypatch) -> None:
    arena = WeightArena(model, "cpu")
    before = _snapshot(model)
    arena.offload()
    driver = arena.tensor._reservation.driver

    def no_memory(size: int, device: int) -> int:
        raise VmmOutOfMemoryError("create", 12)

    monkeypatch.setattr(driver, "create", no_memory)
    with pytest.raises(VmmOutOfMemoryError):
        arena.restore()
    assert arena.is_released and arena.physical_bytes == 0 and arena.host_bytes == arena.nbytes
    monkeypatch.undo()
    assert arena.restore() is True
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
