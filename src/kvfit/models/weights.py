"""Filling a constructed model's parameters: from safetensors checkpoints, or dummy values."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvfit.models.llama import MergedLinear

DUMMY_SEED = 0
DUMMY_STD = 0.02  # small enough that logits stay finite at 8B shapes in bf16
# Buffers some older checkpoints carry; kvfit computes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[torch.Tensor, str]]:
    """Checkpoint tensor name -> (the parameter rows it fills, the name it counts as loaded).

    A `MergedLinear` contributes one name per shard (`...self_attn.q_proj.weight` ...). A tied
    parameter answers to each of its names and counts as loaded under its first one.
    """
    targets: dict[str, tuple[torch.Tensor, str]] = {}
    first_name: dict[int, str] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, MergedLinear):
                parent = module_name.rpartition(".")[0]
                for shard in module.shards:
                    name = f"{parent}.{shard}.{param_name}"
                    targets[name] = (module.shard(param, shard), name)
            else:
                name = f"{module_name}.{param_name}" if module_name else param_name
                targets[name] = (param, first_name.setdefault(id(param), name))
    return targets


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those the sharded index names, else every `*.safetensors`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {folder}; pass load_format='dummy' for random weights"
        )
    return files


def canonical_names(model: nn.Module) -> set[str]:
    """The names a complete load must fill (one per tied parameter, one per fused shard)."""
    return {canonical for _, canonical in checkpoint_targets(model).values()}


@contextmanager
def _reading(file: Path) -> Iterator[None]:
    """A file that cannot be read as safetensors (opened, or a tensor read while loading) is
    named, with what to do about it."""
    try:
        yield
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read the checkpoint file {file}: {e}; it is damaged or "
                         f"incomplete (an interrupted download?): fetch it again") from e


@torch.no_grad()
def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    where: str = "the weights given",
    targets: dict[str, tuple[torch.Tensor, str]] | None = None,
) -> set[str]:
    """Copy each `(checkpoint name, tensor)` into its parameter rows, in place (same addresses;
    dtype and device converted); returns the canonical names filled.

    Names are the Hugging Face checkpoint's (`...q_proj.weight`, as a trainer's state dict
    has them). Raises on a name with no place in the model or a shape that differs; tensors
    copied before the bad one stay copied.
    """
    targets = targets if targets is not None else checkpoint_targets(model)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name not in targets:
            raise ValueError(
                f"checkpoint tensor {name!r} in {where} has no place in "
                f"{type(model).__name__}: is `architectures` in config.json right?"
            )
        rows, canonical = targets[name]
        if tensor.shape != rows.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                f"expects {tuple(rows.shape)}: does config.json match the weights?"
            )
        rows.copy_(tensor)
        loaded.add(canonical)
    return loaded


def load_safetensors(model: nn.Module, folder: Path, device: torch.device) -> None:
    """Copy every checkpoint tensor into its parameter, reading it straight onto `device`.

    Raises if a parameter is left unfilled, a tensor has no place in the model, or shapes differ.
    """
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    for file in safetensors_files(folder):
        with _reading(file), safe_open(file, framework="pt", device=str(device)) as f:
            tensors = ((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118
            loaded |= load_weights(model, tensors, file.name, targets)
    missing = sorted(canonical_names(model) - loaded)
    if missing:
        raise ValueError(f"weights missing from the checkpoint in {folder}: {', '.join(missing)}")


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int = DUMMY_SEED) -> None:
    """Deterministic random weights at the real shapes: norms at one, biases at zero, the rest
    normal(0, DUMMY_STD) from a generator seeded with `seed` on the parameters' device."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)
