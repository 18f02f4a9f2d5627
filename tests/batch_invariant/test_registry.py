"""The batch-invariant ops' self-tests on the CPU (two threads, so thread splits are exercised),
and proof that they catch batch-dependent kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfit.batch_invariant import batch_invariant_mode, registry
from kvfit.batch_invariant.matmul import ROW_TILE, batch_invariant_linear, row_tiled_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_op_of_the_mode_is_batch_invariant(dtype: torch.dtype) -> None:
    assert registry.check_all("cpu", dtype) == {}


def test_the_checks_catch_the_default_kernels() -> None:
    """Outside the mode the same checks fail where the default kernels are batch dependent:
    MKL's float32 GEMM, torch's log-sum-exp and the SDPA attention (whose key blocking follows
    the context, so a cached prefix and a decode reduce differently)."""
    g = torch.Generator
    cpu = torch.device("cpu")
    failing = {c.name for c in registry.CHECKS if c.run(cpu, torch.float32, g().manual_seed(0))}
    assert {"linear", "logsumexp", "paged_attention"} <= failing


def test_check_rows_flags_plain_matmul_in_float32() -> None:
    x, w = torch.randn(64, 256), torch.randn(512, 256)
    assert registry.check_rows(registry.rowwise(lambda t: F.linear(t, w), x), 64, (2, 17, 59))
    assert not registry.check_rows(registry.rowwise(lambda t: row_tiled_linear(t, w), x), 64,
                                   (2, 17, 59))


@pytest.mark.parametrize("rows", [0, 1, ROW_TILE, ROW_TILE + 3])
def test_row_tiled_linear_is_a_linear(rows: int) -> None:
    x, w, b = torch.randn(rows, 48), torch.randn(40, 48), torch.randn(40)
    torch.testing.assert_close(row_tiled_linear(x, w, b), F.linear(x, w, b))
    x3 = torch.randn(2, rows, 48)
    torch.testing.assert_close(batch_invariant_linear(x3, w), F.linear(x3, w))


def test_the_mode_is_scoped() -> None:
    from kvfit.batch_invariant import is_batch_invariant

    assert not is_batch_invariant()
    with batch_invariant_mode():
        assert is_batch_invariant()
        with batch_invariant_mode(False):
            assert not is_batch_invariant()
        assert is_batch_invariant()
    assert not is_batch_invariant()
