"""`ops/pdl.py`'s launch policy: which steps' kernels launch with programmatic dependent launch
and where each releases its successor. The launches themselves are timed by the benches and
checked on a GPU (`tests/engine/test_engine_gpu.py`, `tests/ops/test_triton_skinny.py`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvfit.ops import pdl  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA device of compute capability 9.0, as far as `use_pdl` asks."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_by_default_only_one_token_steps_launch_with_pdl(hopper: None) -> None:
    assert pdl.PDL_DEFAULT is None and pdl.PDL_MAX_ROWS == 1
    assert pdl.use_pdl(None, CUDA, 1)
    assert not pdl.use_pdl(None, CUDA, 2)
    assert pdl.use_pdl(True, CUDA, 16) and not pdl.use_pdl(False, CUDA, 1)


def test_the_module_switch_overrides_the_row_rule(hopper: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "PDL_DEFAULT", True)
    assert pdl.use_pdl(None, CUDA, 16)
    monkeypatch.setattr(pdl, "PDL_DEFAULT", False)
    assert not pdl.use_pdl(None, CUDA, 1)


def test_no_pdl_before_hopper_or_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert not pdl.use_pdl(True, CUDA, 1)
    assert not pdl.use_pdl(True, torch.device("cpu"), 1)


def test_short_layers_release_early_and_long_ones_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 0.6B shape's layers (4-12 MiB) release their successors early, the 8B's (32-192
    MiB) late, the kernels without weights early; `PDL_EARLY` set either way rules all."""
    mib = 1 << 20
    assert pdl.pdl_keywords(12 * mib) == dict(PDL=True, PDL_EARLY=True, launch_pdl=True)
    assert pdl.pdl_keywords(32 * mib)["PDL_EARLY"] is False
    assert pdl.pdl_keywords()["PDL_EARLY"] is True
    for early in (True, False):
        monkeypatch.setattr(pdl, "PDL_EARLY", early)
        assert pdl.pdl_keywords(4 * mib)["PDL_EARLY"] is early
        assert pdl.pdl_keywords(192 * mib)["PDL_EARLY"] is early
