"""The batch-invariant ops' self-tests on the GPU: the Triton GEMM, log-sum-exp and
single-kernel attention, and the default kernels the mode replaces failing the same checks."""

from __future__ import annotations

import pytest
import torch

from kvfit.batch_invariant import registry

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_op_of_the_mode_is_batch_invariant_on_the_gpu(dtype: torch.dtype) -> None:
    assert registry.check_all("cuda", dtype) == {}


def test_the_checks_catch_the_default_attention_on_the_gpu() -> None:
    """Outside the mode a decode runs the split-KV kernel and a prefill row the other one."""
    cuda = torch.device("cuda")
    check = next(c for c in registry.CHECKS if c.name == "paged_attention")
    with torch.inference_mode():
        assert check.run(cuda, torch.bfloat16, torch.Generator().manual_seed(0))
