"""TEMPORARY (replaced by the filters branch): sort-based thresholds so the engine can be tested."""

from __future__ import annotations

import torch

from kvfit.ops.sampling import gumbel_sample as _gumbel


def filter_thresholds(logits, temperature, top_k, top_p, min_p):
    x = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    n, v = x.shape
    s, _ = x.sort(dim=-1, descending=True)
    keep = torch.ones_like(s, dtype=torch.bool)
    if min_p is not None:
        keep &= s >= s[:, :1] + torch.log(min_p.clamp_min(1e-30))[:, None]
    if top_k is not None:
        keep &= torch.arange(v)[None, :] < top_k[:, None]
    if top_p is not None:
        p = torch.where(keep, (s - s[:, :1]).exp(), 0.0)
        p = p / p.sum(-1, keepdim=True)
        before = p.cumsum(-1) - p
        keep &= before < top_p[:, None]
    count = keep.sum(-1)
    raw = logits.float().sort(dim=-1, descending=True).values
    thr = raw.gather(1, (count - 1)[:, None]).squeeze(1)
    off = (temperature <= 0)
    if top_k is None and top_p is None and min_p is None:
        off |= True
    return torch.where(off, float("-inf"), thr)


def gumbel_sample(logits, temperature, seeds, thresholds=None):
    if thresholds is not None:
        logits = logits.masked_fill(logits.float() < thresholds[:, None], float("-inf"))
    return _gumbel(logits, temperature, seeds)
