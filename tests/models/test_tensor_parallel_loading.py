"""Sharded loading: a tensor-parallel rank fills its parameters with its slice of each
checkpoint tensor, read through `get_slice` (never a whole tensor it does not keep)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvfit.distributed import parallel_state
from kvfit.models import weights
from kvfit.models.loader import load_hf_config, load_model


class SliceOnly:
    """`safe_open` that records each tensor's requested index and refuses whole reads."""

    def __init__(self, real: Callable, reads: dict) -> None:
        self.real, self.reads = real, reads

    def __call__(self, *args: object, **kwargs: object) -> SliceOnly:
        self.file = self.real(*args, **kwargs)
        return self

    def __enter__(self) -> SliceOnly:
        self.file.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.file.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        raise AssertionError(f"whole read of {name}")

    def get_slice(self, name: str) -> object:
        part, reads = self.file.get_slice(name), self.reads

        class Recorded:
            def get_shape(self) -> list[int]:
                return part.get_shape()

            def __getitem__(self, index: object) -> torch.Tensor:
                reads[name] = index
                return part[index]

        return Recorded()


@pytest.mark.parametrize("rank, size", [(1, 2), (3, 4)])  # KV heads split; replicated
def test_rank_loads_only_its_slices(
    rank: int, size: int, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_model("llama")  # 4 heads of 16, 2 KV heads, q/k/v bias, untied head
    monkeypatch.setattr(parallel_state._state, "rank", rank)
    monkeypatch.setattr(parallel_state._state, "size", size)
    reads: dict = {}
    monkeypatch.setattr(weights, "safe_open", SliceOnly(weights.safe_open, reads))
    config = load_hf_config(str(folder))
    model = load_model(config, str(folder), torch.float32, torch.device("cpu"), "safetensors")
    hf = load_file(folder / "model.safetensors")
    layer, prefix = model.model.layers[1], "model.layers.1."
    d, heads, kv_head = 16, 4 // size, rank * 2 // size  # kv head r * kv / tp
    qkv_w, qkv_b = layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias
    q_rows = slice(rank * heads * d, (rank + 1) * heads * d)
    kv_rows = slice(kv_head * d, (kv_head + 1) * d)
    assert torch.equal(qkv_w[: heads * d], hf[prefix + "self_attn.q_proj.weight"][q_rows])
    assert torch.equal(qkv_w[heads * d : heads * d + d],
                       hf[prefix + "self_attn.k_proj.weight"][kv_rows])
    assert torch.equal(qkv_b[-d:], hf[prefix + "self_attn.v_proj.bias"][kv_rows])
    assert torch.equal(layer.self_attn.o_proj.weight,
                       hf[prefix + "self_attn.o_proj.weight"][:, q_rows])
    assert torch.equal(layer.self_attn.o_proj.bias, hf[prefix + "self_attn.o_proj.bias"])
    inter = 128 // size
    assert torch.equal(layer.mlp.down_proj.weight,
                       hf[prefix + "mlp.down_proj.weight"][:, rank * inter : (rank + 1) * inter])
    vocab = 512 // size
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"][rank * vocab:][:vocab])
    # Every split tensor was read as a slice; replicated ones (norms, the o_proj bias) whole.
    assert reads[prefix + "self_attn.q_proj.weight"] == (slice(rank * heads * d,
                                                               (rank + 1) * heads * d),)
    assert reads[prefix + "mlp.down_proj.weight"] == (slice(None), slice(rank * inter,
                                                                         (rank + 1) * inter))
    assert reads[prefix + "input_layernorm.weight"] == slice(None)
