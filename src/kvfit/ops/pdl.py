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
their SMs, never hold one that a program of the predecessor still needs. Off (`PDL_DEFAULT`):
`bench/throughput.py --pdl both --pdl-trigger early late` timed whole decode steps (H100,
eee7332) 7.8% (early) and 6% (late) faster at one row on the 0.6B shape, 2.6% slower (early)
and within 0.4% (late) on the 8B, and within 1-2% either way at 4-16 rows: too little where the
batch-1 targets lie to be worth a second launch path by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvfit.ops.small_batch import MAX_ROWS, is_small_batch_enabled

PDL_DEFAULT = False
"""Whether the small-batch step's kernels launch with PDL (`pdl=None`) where the device has it;
`bench/skinny_linear.py` times the skinny kernels each way, `bench/throughput.py --pdl` whole
decode steps (the module docstring has the figures that keep it off)."""
PDL_EARLY = True
"""Where a PDL kernel lets its successor start: right after its own wait (early: the
successor's programs become resident while this kernel runs), or once its main loop is done,
before its last stores (late: the successor's launch and its weight prefetch overlap this
kernel's tail only). Early is the default where PDL is on: it is the faster at one row on the
0.6B shape; on the 8B its successors' waiting programs hold shared memory (49-108 KB a program
of the skinny kernels at one row) on SMs the larger grids need, and late is the faster there
(`bench/throughput.py --pdl-trigger early late`, docs/benchmarks.md). The successor waits for
this kernel's completion either way, so both give the same bits."""


def use_pdl(pdl: bool | None, device: torch.device) -> bool:
    """`pdl`, or `PDL_DEFAULT` where None; only on a CUDA device of compute capability 9.0+."""
    wanted = PDL_DEFAULT if pdl is None else pdl
    return wanted and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(num_tokens: int, device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel of a step of `num_tokens` tokens: `PDL` and `PDL_EARLY`
    (for `wait_then_release` and `release_late`) and Triton's `launch_pdl` where the
    small-batch kernels are on, the step has at most `MAX_ROWS` tokens and `use_pdl` says so;
    none otherwise."""
    if is_small_batch_enabled() and 0 < num_tokens <= MAX_ROWS and use_pdl(None, device):
        return pdl_keywords()
    return {}


def pdl_keywords() -> dict[str, bool]:
    """A PDL launch's keywords: the kernel's `PDL` and `PDL_EARLY` constexprs and Triton's
    `launch_pdl`."""
    return dict(PDL=True, PDL_EARLY=PDL_EARLY, launch_pdl=True)


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
