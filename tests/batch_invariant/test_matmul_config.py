"""`matmul_triton`'s `config`: by default `matmul_config(M, N, K, dtype)` (the one the mode
runs), else the config given (`bench/batch_invariant_gemm.py` times candidates through it); and
the configs `matmul_config` may pick for one weight differ in tile shape only, never in BLOCK_K,
so a row reduces alike whichever runs. The launch is captured instead of run, so this needs
Triton to import, not a GPU."""

from __future__ import annotations

import pytest
import torch

triton_matmul = pytest.importorskip("kvfit.batch_invariant.triton_matmul")
SMALL_M, LARGE_M = triton_matmul.SMALL_M, triton_matmul.LARGE_M


class Launches:
    """Stands in for the jitted kernel: `kernel[grid](*args, **kwargs)` is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], dict]] = []

    def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
        return lambda *args, **kwargs: self.calls.append((grid, kwargs))


@pytest.mark.parametrize("n", [1000, 3000, 9000])  # each of matmul_config's BLOCK_N widths
def test_config_defaults_to_the_mode_s_own(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    launches = Launches()
    monkeypatch.setattr(triton_matmul, "_matmul_kernel", launches)
    x, w = torch.randn(70, 64), torch.randn(n, 64)
    own = triton_matmul.matmul_config(70, n, 64, torch.float32)
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


SHAPES = [(1024, 2048), (4096, 1024), (6144, 1024), (151_936, 4096), (4096, 12_288)]
"""(N, K) of the 0.6B and 8B shapes' GEMMs: narrow, square-ish, wide and the LM head."""


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_tiles_follow_m_with_one_block_k(n: int, k: int, dtype: torch.dtype) -> None:
    configs = {m: triton_matmul.matmul_config(m, n, k, dtype)
               for m in (1, SMALL_M, SMALL_M + 1, LARGE_M - 1, LARGE_M, 8192)}
    assert {c["BLOCK_K"] for c in configs.values()} == {64}
    assert configs[1] == configs[SMALL_M]  # decode steps: one narrow config
    assert configs[LARGE_M] == configs[8192] != configs[1]  # prefill chunks: the big tiles
    assert configs[LARGE_M]["BLOCK_M"] == 128
    # Between them only the wide weights (gate_up, the LM head) take the big tiles.
    assert (configs[SMALL_M + 1] == configs[LARGE_M]) == (n >= 6 * k)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_float32_keeps_one_config_for_every_m(n: int, k: int) -> None:
    """FMA-unit dots reduce in an order that follows the tile layout: float32 may not switch."""
    configs = [triton_matmul.matmul_config(m, n, k, torch.float32) for m in (1, 200, 8192)]
    assert configs[0] == configs[1] == configs[2]
