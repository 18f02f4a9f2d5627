"""Filling a constructed model's parameters: from safetensors checkpoints, or dummy values."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvfit.models.parallel_layers import MergedColumnParallelLinear, Shard

DUMMY_SEED = 0
DUMMY_STD = 0.02  # small enough that logits stay finite at 8B shapes in bf16
# Buffers some older checkpoints carry; kvfit computes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# vLLM's names of an attention layer's FP8 KV cache scales, after the layer's own name (what
# llm-compressor, ModelOpt and older checkpoints write) -> the scales each sets; `kv_scale`
# (deprecated) is both. The q and softmax scales of quantised attention set none: kvfit
# computes attention unquantised.
_ATTENTION_SCALES = {
    "k_scale": "k", "attn.k_scale": "k", "k_proj.k_scale": "k", "k_proj.output_scale": "k",
    "v_scale": "v", "attn.v_scale": "v", "v_proj.v_scale": "v", "v_proj.output_scale": "v",
    "kv_scale": "kv", "attn.kv_scale": "kv",
    "q_scale": "", "attn.q_scale": "", "q_proj.output_scale": "", "prob_scale": "",
    "attn.prob_scale": "",
}
# What quantised weights carry beside (or instead of) `weight`: fp8 (compressed-tensors,
# ModelOpt, block-wise), int4/int8 (GPTQ, AWQ) scales, zero points and packed values.
_QUANTIZED_WEIGHT_SUFFIXES = (
    ".weight_scale", ".weight_scale_inv", ".input_scale", ".weight_zero_point",
    ".weight_packed", ".weight_shape", ".weight_global_scale", ".input_global_scale",
    ".qweight", ".qzeros", ".scales", ".g_idx",
)
# Weights saved with torch.save (pytorch_model.bin and its shards): pickles, which kvfit does not
# read.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `rows` of a parameter, the name it counts as loaded
    under, and the part of the checkpoint tensor this rank keeps (None: all of it)."""

    rows: torch.Tensor
    canonical: str
    shard: Shard | None = None

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        shape = self.rows.shape
        return tuple(shape) if self.shard is None else self.shard.full_shape(shape)

    def local_rows(self) -> torch.Tensor:
        """The rows the kept part fills (a padded vocabulary shard has more rows than that)."""
        if self.shard is None:
            return self.rows
        return self.rows.narrow(self.shard.dim, 0, self.shard.size)


def checkpoint_targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint tensor name -> its `Target` in `model`.

    A `MergedColumnParallelLinear` contributes one name per projection
    (`...self_attn.q_proj.weight` ...). A tied parameter answers to each of its names and counts
    as loaded under its first one. Tensor-parallel modules name each parameter's `Shard`.
    """
    targets: dict[str, Target] = {}
    first_name: dict[int, str] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, MergedColumnParallelLinear):
                parent = module_name.rpartition(".")[0]
                for shard_name, shard in module.shards.items():
                    name = f"{parent}.{shard_name}.{param_name}"
                    targets[name] = Target(module.shard(param, shard_name), name, shard)
            else:
                name = f"{module_name}.{param_name}" if module_name else param_name
                shard = getattr(module, "tp_shards", {}).get(param_name)
                targets[name] = Target(param, first_name.setdefault(id(param), name), shard)
    return targets


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those the sharded index names, else every `*.safetensors`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [folder / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is no sharded-checkpoint index: it needs a 'weight_map' "
                             f"object from tensor names to file names ({e!r})") from None
    files = sorted(folder.glob("*.safetensors"))
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if not files and pickles:
        raise FileNotFoundError(
            f"{folder} holds PyTorch pickle weights ({', '.join(pickles)}) and no "
            f"*.safetensors: kvfit reads safetensors only. Convert them, e.g. with transformers: "
            f"AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst) writes safetensors"
        )
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {folder}; pass load_format='dummy' for random weights"
        )
    return files


def canonical_names(model: nn.Module) -> set[str]:
    """The names a complete load must fill (one per tied parameter, one per fused shard)."""
    return {target.canonical for target in checkpoint_targets(model).values()}


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
    targets: dict[str, Target] | None = None,
) -> set[str]:
    """Copy each whole `(checkpoint name, tensor)` into its parameter rows, in place (same
    addresses; dtype and device converted; under tensor parallelism this rank's part of it);
    returns the canonical names filled.

    Names are the Hugging Face checkpoint's (`...q_proj.weight`, as a trainer's state dict
    has them). Raises on a name with no place in the model or a shape that differs; tensors
    copied before the bad one stay copied.
    """
    targets = targets if targets is not None else checkpoint_targets(model)
    attention = _attention_modules(model)
    filled: dict[str, str] = {}
    for name, tensor in weights:
        if _take_attention_scale(attention, name, lambda t=tensor: t):
            continue
        target = _target(targets, name, where, model, tuple(tensor.shape))
        if target is None:
            continue
        _fill(target, name, tensor if target.shard is None else target.shard.take(tensor), filled)
    return set(filled)


def _attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> attention module (those that keep a checkpoint's KV cache scales)."""
    return {name: module for name, module in model.named_modules()
            if hasattr(module, "checkpoint_kv_scales")}


def _take_attention_scale(attention: dict[str, nn.Module], name: str,
                          read: Callable[[], torch.Tensor]) -> bool:
    """Whether checkpoint tensor `name` is one of an attention layer's scales (vLLM's names,
    `_ATTENTION_SCALES`); a k/v one is kept, with its name, in the layer's
    `checkpoint_kv_scales` (on the host), which an fp8 KV cache then reads (vLLM's semantics:
    a 16-bit cache and `calculate_kv_scales` ignore them)."""
    for suffix, scales in _ATTENTION_SCALES.items():
        module = attention.get(name[: -len(suffix) - 1]) if name.endswith("." + suffix) else None
        if module is not None:
            if scales:
                value = read().detach().to("cpu", torch.float32)
                for which in scales:
                    module.checkpoint_kv_scales[which] = (name, value)
            return True
    return False


def _fill(target: Target, name: str, value: torch.Tensor, filled: dict[str, str]) -> None:
    """Copy checkpoint tensor `name`'s `value` into `target`'s rows; `filled` maps each canonical
    name filled so far to the checkpoint name that filled it.

    A tied parameter (lm_head.weight sharing embed_tokens.weight) filled by two checkpoint tensors
    that differ is refused: transformers unties such a model, so either value would be wrong."""
    rows = target.local_rows()
    first = filled.setdefault(target.canonical, name)
    if first != name and not torch.equal(rows, value.to(rows.dtype)):
        raise ValueError(
            f"checkpoint tensors {first!r} and {name!r} both fill one tied parameter but differ; "
            f"if the checkpoint's lm_head is its own, set tie_word_embeddings to false in "
            f"config.json"
        )
    with torch.no_grad():
        rows.copy_(value)


def _target(targets: dict[str, Target], name: str, where: str, model: nn.Module,
            shape: tuple[int, ...]) -> Target | None:
    """`name`'s target, checked against the checkpoint tensor's `shape`; None to skip it."""
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    if name not in targets and name.endswith(_QUANTIZED_WEIGHT_SUFFIXES):
        raise ValueError(
            f"checkpoint tensor {name!r} in {where} belongs to a quantised weight (config.json "
            f"quantization_config); kvfit runs unquantised checkpoints (float32, bfloat16, "
            f"float16): load the unquantised model, and --kv-cache-dtype fp8 for an fp8 KV cache"
        )
    if name not in targets:
        raise ValueError(
            f"checkpoint tensor {name!r} in {where} has no place in "
            f"{type(model).__name__}: is `architectures` in config.json right?"
        )
    target = targets[name]
    if shape != target.checkpoint_shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {shape}, the model "
            f"expects {target.checkpoint_shape}: does config.json match the weights?"
        )
    return target


def load_safetensors(model: nn.Module, folder: Path, device: torch.device) -> None:
    """Copy every checkpoint tensor into its parameter, reading it straight onto `device`;
    under tensor parallelism only the part this rank keeps is read (`get_slice`).

    Raises if a parameter is left unfilled, a tensor has no place in the model, or shapes differ.
    """
    targets = checkpoint_targets(model)
    attention = _attention_modules(model)
    filled: dict[str, str] = {}
    for file in safetensors_files(folder):
        with _reading(file), safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118
                if _take_attention_scale(attention, name, lambda f=f, n=name: f.get_tensor(n)):
                    continue
                part = f.get_slice(name)
                target = _target(targets, name, file.name, model, tuple(part.get_shape()))
                if target is None:
                    continue
                index = () if target.shard is None else target.shard.index()
                _fill(target, name, part[index] if index else part[:], filled)
    missing = sorted(canonical_names(model) - set(filled))
    if missing:
        raise ValueError(f"weights missing from the checkpoint in {folder}: {', '.join(missing)}")


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int = DUMMY_SEED) -> None:
    """Deterministic random weights at the real shapes: norms at one, biases at zero, the rest
    normal(0, DUMMY_STD) from a generator seeded with `seed` on the parameters' device.

    Under tensor parallelism each rank draws every parameter whole, as one rank holds it, and
    keeps its part: the model, and so greedy output, is the same at every tensor_parallel_size.
    """
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    owners: dict[int, tuple[nn.Module, str]] = {}
    for module in model.modules():
        for param_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), (module, param_name))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            _draw_sharded(*owners[id(param)], param, generator)


def _draw_sharded(module: nn.Module, param_name: str, param: torch.Tensor,
                  generator: torch.Generator) -> None:
    """Fill `param` with its part of the whole parameter drawn from `generator` (what one rank
    would hold: a fused projection's parts stacked, an unpadded vocabulary)."""
    if isinstance(module, MergedColumnParallelLinear):
        parts = [(module.shard(param, name), shard) for name, shard in module.shards.items()]
    else:
        shard = getattr(module, "tp_shards", {}).get(param_name)
        parts = [(param, None) if shard is None else (param.narrow(shard.dim, 0, shard.size),
                                                      shard)]
    if all(shard is None or (shard.start, shard.size) == (0, shard.full) for _, shard in parts) \
            and sum(rows.numel() for rows, _ in parts) == param.numel():
        param.normal_(0.0, DUMMY_STD, generator=generator)  # one rank: nothing to cut
        return
    shapes = [rows.shape if shard is None else shard.full_shape(rows.shape)
              for rows, shard in parts]
    whole = torch.empty((sum(shape[0] for shape in shapes), *shapes[0][1:]), dtype=param.dtype,
                        device=param.device).normal_(0.0, DUMMY_STD, generator=generator)
    for (rows, shard), full in zip(parts, whole.split([s[0] for s in shapes]), strict=True):
        rows.copy_(full if shard is None else shard.take(full))
