"""Seeded Gumbel-max sampling of one token per logits row: Triton on CUDA, torch elsewhere."""

from __future__ import annotations

import torch

LOGITS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gumbel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """Sample one token id per row of `logits` `[N, V]` from softmax(logits / temperature).

    Each row n takes the argmax of `logits[n] / temperature[n] + g` with g Gumbel noise drawn
    from `seeds[n]` alone, so the same seed and logits give the same token whatever the batch.
    Rows with temperature <= 0 take the plain argmax (first index on ties). Filtered or banned
    tokens (-inf logits) never win unless the whole row is -inf. `temperature` is `[N]` float32,
    `seeds` `[N]` int64 (a 64-bit seed as its two's-complement int64); returns `[N]` int64.
    CUDA and CPU draw different noise for the same seed.
    """
    if logits.is_cuda:
        from kvfit.ops.triton_sampling import gumbel_sample_triton  # CUDA-only dependency

        return gumbel_sample_triton(logits, temperature, seeds)
    return gumbel_sample_torch(logits, temperature, seeds)


def gumbel_sample_torch(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """The torch path of `gumbel_sample` (CPU): the same math with each row's noise from a
    `torch.Generator` seeded by `seeds[row]`."""
    check_sample_inputs(logits, temperature, seeds)
    sample = temperature > 0
    scores = logits.float() / torch.where(sample, temperature, 1.0)[:, None]
    noise = torch.empty_like(scores)
    for row, seed in enumerate(seeds.tolist()):
        noise[row].exponential_(generator=torch.Generator(logits.device).manual_seed(seed))
    # Exp(1) noise can be exactly 0; the floor keeps Gumbel noise finite so -inf stays -inf.
    gumbel = noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()
    return torch.where(sample[:, None], scores + gumbel, scores).argmax(dim=-1)


def check_sample_inputs(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
) -> None:
    """Raise ValueError unless logits is `[N, V>0]` in a supported dtype and temperature
    (`[N]` float32) and seeds (`[N]` int64) sit on its device. Reads no values (no sync)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [num_rows, vocab_size > 0], got {tuple(logits.shape)}")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits dtype {logits.dtype} is not one of {LOGITS_DTYPES}")
    for name, t, dtype in (("temperature", temperature, torch.float32),
                           ("seeds", seeds, torch.int64)):  # fmt: skip
        if t.shape != logits.shape[:1] or t.dtype != dtype or t.device != logits.device:
            raise ValueError(
                f"{name} must be [{logits.shape[0]}] {dtype} on {logits.device}, got "
                f"{list(t.shape)} {t.dtype} on {t.device}"
            )
