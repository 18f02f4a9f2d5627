"""`cudagraph_mode` / `--cudagraph-mode`: vLLM's names, any case; a wrong one names the setting."""

from __future__ import annotations

import argparse

import pytest

from kvfit.engine.config import CUDAGRAPH_MODES, EngineArgs


def test_default_keeps_prefill_eager_and_any_case_is_accepted() -> None:
    assert EngineArgs(model="kvfit-tiny", device="cpu").create_engine_config(
    ).cudagraph_mode == "FULL_DECODE_ONLY"
    config = EngineArgs(model="kvfit-tiny", device="cpu",
                        cudagraph_mode="full_and_piecewise").create_engine_config()
    assert config.cudagraph_mode == "FULL_AND_PIECEWISE"


def test_an_unknown_mode_names_the_setting() -> None:
    with pytest.raises(ValueError, match="cudagraph_mode must be one of NONE, PIECEWISE"):
        EngineArgs(model="kvfit-tiny", device="cpu", cudagraph_mode="FULL").create_engine_config()


def test_the_flag_parses_into_engine_args() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for mode in CUDAGRAPH_MODES:
        args = parser.parse_args(["--cudagraph-mode", mode.lower()])
        assert EngineArgs.from_cli_args(args).cudagraph_mode == mode
    with pytest.raises(SystemExit):
        parser.parse_args(["--cudagraph-mode", "full"])
