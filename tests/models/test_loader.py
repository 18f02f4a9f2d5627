"""Configs, tokenizers and weight loading: built-ins, local folders, sharded checkpoints, errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvfit.models.configs.build_tiny_tokenizer import build as build_tiny_tokenizer
from kvfit.models.llama import rope_parameters
from kvfit.models.loader import (
    BUILTIN_DIR,
    BUILTIN_MODELS,
    load_eos_token_ids,
    load_hf_config,
    load_model,
    load_tokenizer,
)
from kvfit.models.registry import MODELS, get_model_class
from kvfit.models.weights import checkpoint_targets

CPU = torch.device("cpu")


def copy_config(src: Path, dst: Path, **overrides) -> Path:
    config = json.loads((src / "config.json").read_text()) | overrides
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_builtin_model_has_hf_checkpoint_layout(name: str) -> None:
    """Every checkpoint name and shape HF expects for the built-in config has a place in kvfit's
    model (built on the meta device: real shapes, no memory)."""
    config = load_hf_config(name)
    assert get_model_class(config) is MODELS[config.architectures[0]]
    with torch.device("meta"):
        ours = get_model_class(config)(config)
        hf = AutoModelForCausalLM.from_config(config)
    expected = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    targets = {
        n: target.checkpoint_shape
        for n, target in checkpoint_targets(ours).items()
        if n == target.canonical
    }
    assert targets == expected


def test_tiny_tokenizer_matches_its_config() -> None:
    config, tokenizer = load_hf_config("kvfit-tiny"), load_tokenizer("kvfit-tiny")
    assert len(tokenizer) == config.vocab_size
    assert tokenizer.eos_token_id == config.eos_token_id
    text = "Hello, wörld! 🚀"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n") and "hi<|im_end|>" in chat


def test_tiny_tokenizer_files_are_what_the_script_builds(tmp_path: Path) -> None:
    build_tiny_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (BUILTIN_DIR / "kvfit-tiny" / name).read_bytes()


def test_shape_configs_have_no_tokenizer() -> None:
    assert load_tokenizer("qwen3-0.6b-shape") is None


def test_folder_without_tokenizer(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    assert load_tokenizer(str(tiny_model("qwen3"))) is not None
    assert load_tokenizer(str(copy_config(tiny_model("qwen3"), tmp_path / "m"))) is None


def test_eos_ids_outside_the_vocabulary_are_dropped(
    tiny_model: Callable[[str], Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The sampler bans EOS ids below min_tokens at row * vocab_size + id: one outside the
    # vocabulary would index past the logits, or ban a token of another row.
    folder = copy_config(tiny_model("qwen3"), tmp_path / "m", eos_token_id=[2, 512])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [-1, 7]}))
    assert load_eos_token_ids(str(folder), load_hf_config(str(folder))) == [2, 7]
    assert "512" in caplog.text and "-1" in caplog.text and "vocab_size" in caplog.text


def test_unknown_model_name() -> None:
    with pytest.raises(FileNotFoundError, match="kvfit-tiny"):
        load_hf_config("no-such-model")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(str(tmp_path))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_path_to_a_file_names_its_folder(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A file of the model given instead of its folder (relative `dir/file` too, which is no
    Hub id to download) is named, with the folder to pass."""
    folder = tiny_model("qwen3")
    monkeypatch.chdir(folder.parent)
    for path in (str(folder / name), f"{folder.name}/{name}"):
        with pytest.raises(FileNotFoundError, match=rf"is a file.*{folder.name}") as info:
            load_hf_config(path)
        assert "download" not in str(info.value)


def test_unknown_architecture(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    folder = copy_config(tiny_model("llama"), tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*architectures.*Qwen3ForCausalLM"):
        load_model(load_hf_config(str(folder)), str(folder), torch.float32, CPU, "dummy")


@pytest.mark.parametrize(
    "custom_code", [{}, {"auto_map": {"AutoConfig": "configuration_foo.FooConfig"}}]
)
def test_architecture_transformers_does_not_know(
    tiny_model: Callable[[str], Path], tmp_path: Path, custom_code: dict
) -> None:
    """A model_type unknown to transformers (or one that needs the folder's own code) is
    kvfit's unsupported architecture, named with the supported ones; no prompt, no advice to
    upgrade transformers or trust remote code."""
    folder = copy_config(tiny_model("qwen3"), tmp_path / "m", model_type="foo",
                         architectures=["FooForCausalLM"], **custom_code)
    with pytest.raises(ValueError, match="FooForCausalLM.*architectures.*Qwen3ForCausalLM"):
        load_hf_config(str(folder))


def test_an_index_without_a_weight_map_is_named(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(tiny_model("llama"), tmp_path / "m"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    config = load_hf_config(str(folder))
    with pytest.raises(ValueError, match="model.safetensors.index.json is no sharded"):
        load_model(config, str(folder), torch.float32, CPU, "safetensors")


def test_sharded_checkpoint_loads_like_single_file(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    single = tiny_model("llama")
    hf = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config = load_hf_config(str(single))
    want = state_dict(load_model(config, str(single), torch.float32, CPU, "auto"))
    got = state_dict(load_model(config, str(tmp_path), torch.float32, CPU, "safetensors"))
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_checkpoint_values_land_in_fused_rows(tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model("llama")
    checkpoint = load_file(folder / "model.safetensors")
    model = load_model(load_hf_config(str(folder)), str(folder), torch.float32, CPU, "auto")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    q_rows = attn.num_heads * attn.head_dim
    k_rows = attn.num_kv_heads * attn.head_dim
    prefix = "model.layers.1."
    assert torch.equal(
        attn.qkv_proj.bias[q_rows : q_rows + k_rows], checkpoint[prefix + "self_attn.k_proj.bias"]
    )
    assert torch.equal(
        mlp.gate_up_proj.weight[mlp.down_proj.in_features :],
        checkpoint[prefix + "mlp.up_proj.weight"],
    )


def test_checkpoint_dtype_is_cast(tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model("qwen3")
    model = load_model(load_hf_config(str(folder)), str(folder), torch.bfloat16, CPU, "auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tied_embeddings_with_an_lm_head_in_the_file(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """tie_word_embeddings with lm_head.weight in the checkpoint: the same values load tied; other
    values (transformers then unties them) are refused, naming both tensors and the setting."""
    src = tiny_model("qwen3")
    tensors = load_file(src / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    config = load_hf_config(str(src))
    same = copy_config(src, tmp_path / "same")
    save_file(tensors | {"lm_head.weight": embed.clone()}, same / "model.safetensors")
    model = load_model(config, str(same), torch.float32, CPU, "auto")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embed)
    differ = copy_config(src, tmp_path / "differ")
    save_file(tensors | {"lm_head.weight": embed.flip(0)}, differ / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.*embed_tokens.*tie_word_embeddings"):
        load_model(config, str(differ), torch.float32, CPU, "auto")


def test_missing_weight_is_named(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny_model("qwen3")
    folder = copy_config(src, tmp_path / "m")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"], tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_norm\.weight, model\.norm"):
        load_model(load_hf_config(str(folder)), str(folder), torch.float32, CPU, "auto")


def test_shape_mismatch_is_named(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny_model("qwen3")
    folder = copy_config(src, tmp_path / "m", intermediate_size=96)
    shutil.copy(src / "model.safetensors", folder)
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape"):
        load_model(load_hf_config(str(folder)), str(folder), torch.float32, CPU, "auto")


@pytest.mark.parametrize("suffix", ["weight_scale", "weight_scale_inv", "input_scale"])
def test_an_fp8_weight_checkpoint_is_named_as_quantised(
    tiny_model: Callable[[str], Path], tmp_path: Path, suffix: str
) -> None:
    # An FP8 checkpoint (Qwen3-8B-FP8, llm-compressor's) was blamed on `architectures`.
    src = tiny_model("qwen3")
    folder = copy_config(src, tmp_path / "m")
    tensors = load_file(src / "model.safetensors")
    tensors[f"model.layers.0.mlp.up_proj.{suffix}"] = torch.ones(1)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"'model.layers.0.mlp.up_proj.{suffix}' .* quantised "
                                         rf"weight .* --kv-cache-dtype fp8 for an fp8 KV cache"):
        load_model(load_hf_config(str(folder)), str(folder), torch.float32, CPU, "auto")


def test_folder_without_weights_suggests_dummy(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = copy_config(tiny_model("qwen3"), tmp_path / "m")
    config = load_hf_config(str(folder))
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        load_model(config, str(folder), torch.float32, CPU, "auto")
    model = load_model(config, str(folder), torch.float32, CPU, "dummy")
    assert model.model.embed_tokens.weight.shape == (config.vocab_size, config.hidden_size)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickle_only_folder_says_safetensors_is_needed(
    tiny_model: Callable[[str], Path], tmp_path: Path, name: str
) -> None:
    """A folder with PyTorch pickle weights only: the error names them and asks for safetensors,
    rather than suggesting random (dummy) weights."""
    src = tiny_model("qwen3")
    folder = copy_config(src, tmp_path / "m")
    torch.save(load_file(src / "model.safetensors"), folder / name)
    with pytest.raises(FileNotFoundError, match=rf"{name}.*safetensors") as info:
        load_model(load_hf_config(str(folder)), str(folder), torch.float32, CPU, "auto")
    assert "dummy" not in str(info.value)


def test_bad_load_format() -> None:
    config = load_hf_config("kvfit-tiny")
    with pytest.raises(ValueError, match="load_format 'pt'"):
        load_model(config, "kvfit-tiny", torch.float32, CPU, "pt")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model(config, "kvfit-tiny", torch.float32, CPU, "safetensors")


def test_rope_parameters_reads_both_spellings() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    legacy = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling})
    current = SimpleNamespace(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling}
    )
    assert (
        rope_parameters(legacy)
        == rope_parameters(current)
        == (500000.0, {"rope_type": "llama3", **scaling})
    )
    plain = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert rope_parameters(plain) == (1e6, None)
    assert rope_parameters(SimpleNamespace(rope_theta=1e4, rope_scaling=None)) == (1e4, None)


def test_a_config_that_is_not_json_is_one_line_naming_the_file(tmp_path: Path) -> None:
    # A truncated download: transformers' OSError went up as a traceback past the CLI's
    # one-line errors.
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", ')
    with pytest.raises(ValueError, match=r"config\.json .*not valid JSON.*fetch it again"):
        load_hf_config(str(tmp_path))


@pytest.mark.parametrize(("fields", "match"), [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "KeyError: .*low_freq_factor"),
    ({"num_attention_heads": "4"}, "StrictDataclass.*num_attention_heads"),
    ({"head_dim": 15}, "StrictDataclass.*even"),
])
def test_a_config_transformers_refuses_is_one_line_naming_the_file(
        tmp_path: Path, fields: dict, match: str) -> None:
    # transformers 5 validates fields with a KeyError or huggingface_hub's strict dataclass
    # errors, no ValueError: a traceback went up past the CLI's one-line errors.
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_attention_heads": 4, "rope_theta": 10000.0, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json is refused by transformers \({match}"):
        load_hf_config(str(tmp_path))
    with pytest.raises(ValueError) as info:
        load_hf_config(str(tmp_path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("content", ['{"bad', "{}"])
def test_a_broken_tokenizer_is_one_line_naming_the_folder(tmp_path: Path, content: str) -> None:
    # Cut short, it was a JSON error naming no file; valid JSON of the wrong shape, a KeyError
    # traceback from inside transformers.
    shutil.copytree(BUILTIN_DIR / "kvfit-sotu", tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match=r"cannot load the tokenizer in .*m\b.*fetch"):
        load_tokenizer(str(tmp_path / "m"))
