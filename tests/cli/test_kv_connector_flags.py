"""`kvfit generate --kv-connector shared_storage --kv-connector-path DIR`: the first run fills
the store, a second process-level run (a new engine) reads it and prints the same text."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfit.cli import main
from kvfit.connectors.block_file import SUFFIX


def test_generate_fills_and_reuses_a_shared_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine_flags: list[str],
) -> None:
    store = tmp_path / "store"
    argv = ["generate", "--prompt-token-ids", ",".join(map(str, range(5, 58))),
            "--max-tokens", "4", "--ignore-eos", *engine_flags, "--log-level", "warning",
            "--kv-connector", "shared_storage", "--kv-connector-path", str(store)]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert len(list(store.glob(f"*{SUFFIX}"))) == 53 // 16  # the prompt's full blocks
    assert main(argv) == 0
    assert capsys.readouterr().out == first


def test_an_unwritable_store_fails_at_startup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine_flags: list[str],
) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="kv_connector_path"):
        main(["generate", "--max-tokens", "1", *engine_flags, "--kv-connector",
              "shared_storage", "--kv-connector-path", str(tmp_path / "file" / "store")])
