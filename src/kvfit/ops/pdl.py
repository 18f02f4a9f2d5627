"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a small-batch decode step.

At decode batch 1 a step is a chain of ~7 kernel nodes a layer, each paced less by its bytes
than by its launch, its first DRAM round trips and its tail. Launched with PDL, a node may start
while the node before it finishes: it waits (`griddepcontrol.wait`, which returns once its
predecessor has completed and its writes are visible) before it touches any memory but what no
kernel writes (weights, which the skinny kernels prefetch first), and then lets its own
successor start (`griddepcontrol.launch_dependents`: right after the wait, or after its main
loop where `PDL_EARLY` is off). Every program of a PDL kernel waits
before it returns, so that "complete" passes down the chain: a kernel that waited on its
predecessor also waited, through it, on every kernel before.

Which kernels: the ones of a step of at most `small_batch.MAX_ROWS` tokens with the small-batch
kernels on (`pdl_launch`): the skinny linear layers, the attention input and the decode
attention with its split reduction; that is where it is timed. A successor launches only once
every program of its predecessor has started and passed its wait, so its programs, waiting on
their SMs, never hold one that a program of the predecessor still needs.

By default (`PDL_DEFAULT` None) only the kernels of one-token steps launch so
(`PDL_MAX_ROWS`), and each releases its successor early unless it streams more than
`EARLY_MAX_WEIGHT_BYTES` of weights (`PDL_EARLY` None). Whole decode steps with K in parts
(H100, 2026-12-07, `bench/throughput.py --pdl both --pdl-trigger early late`, medians of 3 in
one call): at one row the early trigger everywhere was 8.9% faster on the 0.6B shape and 1.9%
slower on the 8B, the late one 2.9% and 0.3% faster; at four rows both were up to 8% slower.
This rule, against PDL off in one later call (`--pdl off`, then `--pdl default`): one row
9.7% faster on the 0.6B (1.133 -> 1.023 ms) and 1.2% on the 8B (6.242 -> 6.168 ms); four
rows unchanged (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvfit.ops.small_batch import MAX_ROWS, is_small_batch_enabled

PDL_DEFAULT: bool | None = None
"""Whether the small-batch step's kernels launch with PDL (`pdl=None`) where the device has it:
True at every small-batch size, False never, None for steps of at most `PDL_MAX_ROWS` tokens.
`bench/skinny_linear.py` times the skinny kernels each way, `bench/throughput.py --pdl` whole
decode steps (the module docstring has the figures)."""
PDL_MAX_ROWS = 1
"""The most tokens of a step whose kernels launch with PDL where `PDL_DEFAULT` is None: at four
rows either trigger made whole decode steps slower on both shapes timed."""
PDL_EARLY: bool | None = None
"""Where a PDL kernel lets its successor start: right after its own wait (early: the
successor's programs become resident while this kernel runs), or once its main loop is done,
before its last stores (late: the successor's launch and its weight prefetch overlap this
kernel's tail only). None: early, but late for a linear layer that streams more than
`EARLY_MAX_WEIGHT_BYTES` of weights. The successor waits for this kernel's completion either
way, so all give the same bits."""
EARLY_MAX_WEIGHT_BYTES = 16 << 20
"""The most weight bytes of a linear layer that releases its successor early where `PDL_EARLY`
is None. Early pays where a kernel is short against its successor's launch (the 0.6B shape's
4-12 MiB layers, ~5-8 us); the 8B's (32-192 MiB) ran faster with the late trigger, their
successors' waiting programs holding shared memory (49-108 KB a program at one row) for tens
of microseconds."""


def use_pdl(pdl: bool | None, device: torch.device, num_tokens: int) -> bool:
    """`pdl`, or `PDL_DEFAULT` where None (and where that is None, `num_tokens <=
    PDL_MAX_ROWS`); only on a CUDA device of compute capability 9.0+."""
    wanted = PDL_DEFAULT if pdl is None else pdl
    if wanted is None:
        wanted = num_tokens <= PDL_MAX_ROWS
    return wanted and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(num_tokens: int, device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel of a step of `num_tokens` tokens: `PDL` and `PDL_EARLY`
    (for `wait_then_release` and `release_late`) and Triton's `launch_pdl` where the
    small-batch kernels are on, the step has at most `MAX_ROWS` tokens and `use_pdl` says so;
    none otherwise."""
    small_step = is_small_batch_enabled() and 0 < num_tokens <= MAX_ROWS
    return pdl_keywords() if small_step and use_pdl(None, device, num_tokens) else {}


def pdl_keywords(weight_bytes: int = 0) -> dict[str, bool]:
    """A PDL launch's keywords: the kernel's `PDL` and `PDL_EARLY` constexprs and Triton's
    `launch_pdl`; the trigger as `PDL_EARLY` says, for a kernel that streams `weight_bytes`."""
    early = weight_bytes <= EARLY_MAX_WEIGHT_BYTES if PDL_EARLY is None else PDL_EARLY
    return dict(PDL=True, PDL_EARLY=early, launch_pdl=True)


@triton.jit
def wait_then_release(PDL: tl.constexpr, EARLY: tl.constexpr = True):
    """A PDL kernel's first statement: wait for the kernel before (its writes visible), then,
    if `EARLY`, let the kernel after start. Nothing where `PDL` is off."""
    if PDL:
        gdc_wait()
        if EARLY:
            gdc_launch_dependents()


@triton.jit
def release_late(PDL: tl.constexpr, EARLY: tl.constexpr):
    """A PDL kernel with a late trigger (not `EARLY`) lets the kernel after start here: after
    its main loop, before its last stores. Nothing otherwise."""
    if PDL and not EARLY:
        gdc_launch_dependents()
