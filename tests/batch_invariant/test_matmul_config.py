"""`matmul_triton`'s `config`: by default the weight's own `matmul_config(N)` (the one the mode
runs), else the config given (`bench/batch_invariant_gemm.py` times candidates through it). The
launch is captured instead of run, so this needs Triton to import, not a GPU."""

from __future__ import annotations

import pytest
import torch

triton_matmul = pytest.importorskip("kvfit.batch_invariant.triton_matmul")


class Launches:
    """Stands in for the jitted kernel: `kernel[grid](*args, **kwargs)` is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], dict]] = []

    def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
        return lambda *args, **kwargs: self.calls.append((grid, kwargs))


@pytest.mark.parametrize("n", [1000, 3000, 9000])  # each of matmul_config's BLOCK_N widths
def test_config_defaults_to_the_weights_own(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    launches = Launches()
    monkeypatch.setattr(triton_matmul, "_matmul_kernel", launches)
    x, w = torch.randn(70, 64), torch.randn(n, 64)
    own = triton_matmul.matmul_config(n)
    other = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    triton_matmul.matmul_triton(x, w)
    triton_matmul.matmul_triton(x, w, config=own)
    triton_matmul.matmul_triton(x, w, config=other)
    (grid, kwargs), explicit, (other_grid, other_kwargs) = launches.calls
    assert {k: kwargs[k] for k in own} == own
    assert grid == (-(-70 // own["BLOCK_M"]) * -(-n // own["BLOCK_N"]),)
    assert explicit == (grid, kwargs)
    assert {k: other_kwargs[k] for k in other} == other
    assert other_grid == (1 * -(-n // 256),)
