"""A Hugging Face repo id (`org/name`) resolves to its snapshot in the local Hugging Face cache
($HF_HUB_CACHE, else $HF_HOME/hub), as vLLM finds a model fetched before; nothing downloads."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfit.models.loader import load_hf_config, load_tokenizer, resolve_model


def cache_snapshot(hub: Path, repo_id: str, model: Path) -> Path:
    """`model`'s files laid out as huggingface_hub caches a download of `repo_id`."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.parametrize("variable", ["HF_HOME", "HF_HUB_CACHE"])
def test_a_repo_id_in_the_local_cache_loads_from_its_snapshot(
    variable: str, tmp_path: Path, tiny_model: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub = tmp_path / "hub"
    snapshot = cache_snapshot(hub, "org/tiny", tiny_model("qwen3"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(variable, str(tmp_path if variable == "HF_HOME" else hub))
    monkeypatch.chdir(tmp_path)  # no ./org/tiny folder
    assert resolve_model("org/tiny") == snapshot
    assert load_hf_config("org/tiny").num_hidden_layers >= 1
    assert load_tokenizer("org/tiny") is not None


def test_a_repo_id_not_in_the_cache_says_how_to_fetch_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache .*hub.*"
                       "hf download org/absent"):
        resolve_model("org/absent")


def test_the_fetch_hint_names_a_program_huggingface_hub_installs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It named `huggingface-cli`, which huggingface_hub 1.0 dropped for `hf`: a user who
    # followed the hint (and the README's) got "command not found".
    from importlib.metadata import distribution

    scripts = {ep.name for ep in distribution("huggingface_hub").entry_points
               if ep.group == "console_scripts"}
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        resolve_model("org/absent")
    command = str(error.value).split("e.g. `", 1)[1].split()[0]
    assert command in scripts
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"`{command} download Qwen/Qwen3-0.6B" in readme
