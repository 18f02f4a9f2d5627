"""From a model name (a local folder or a built-in) to its config, tokenizer and weights."""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from kvfit.models.builtins import BUILTIN_DIR, BUILTIN_MODELS
from kvfit.models.registry import get_model_class, model_class_for
from kvfit.models.weights import init_dummy, load_safetensors

if TYPE_CHECKING:
    from collections.abc import Iterator

    from transformers import PreTrainedTokenizerBase

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

logger = logging.getLogger(__name__)


def resolve_model(model: str) -> Path:
    """The folder holding `model`'s config.json: `model` itself, a built-in's shipped folder,
    or, for a repo id (`org/name`), its snapshot in the local Hugging Face cache."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model folder {folder} has no config.json")
        return folder
    if folder.is_file():
        raise FileNotFoundError(
            f"model {model!r} is a file; kvfit loads a model's folder (config.json, "
            f"*.safetensors, tokenizer files): pass {str(folder.parent)!r}"
        )
    if model in BUILTIN_MODELS:
        return BUILTIN_DIR / model
    if _looks_like_hub_id(model):
        snapshot = cached_snapshot(model)
        if snapshot is not None:
            return snapshot
        name = model.rsplit("/", 1)[1]
        raise FileNotFoundError(
            f"model {model!r} is not a local folder, and not in the Hugging Face cache "
            f"({_hub_cache_dir()}): kvfit loads local Hugging Face folders "
            f"(config.json, *.safetensors, tokenizer files) and downloads nothing. Fetch it "
            f"first, e.g. `{hub_download_command()} {model} --local-dir ./{name}`, then pass "
            f"--model ./{name}"
        )
    raise FileNotFoundError(
        f"model {model!r} is neither a local folder with config.json nor a built-in model "
        f"({', '.join(BUILTIN_MODELS)}); set `model` to one of them"
    )


def hub_download_command() -> str:
    """The installed huggingface_hub's download command: `hf download` from 0.34 on (1.0
    dropped `huggingface-cli`, so naming it sends a user to a program that is not there),
    `huggingface-cli download` before."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(part) for part in version("huggingface_hub").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return "hf download"
    return "hf download" if (major, minor) >= (0, 34) else "huggingface-cli download"


def _hub_cache_dir() -> Path:
    """The Hugging Face cache, read from the environment now (as huggingface_hub places it):
    $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str) -> Path | None:
    """The folder of `repo_id`'s cached snapshot (its main revision) holding a config.json, as
    a vLLM user has after serving it once; None when it is not cached. Never goes online."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        path = try_to_load_from_cache(repo_id, "config.json", cache_dir=_hub_cache_dir())
    except ValueError:  # not a valid repo id after all
        return None
    return Path(path).parent if isinstance(path, str) else None


def _looks_like_hub_id(model: str) -> bool:
    """`org/name` as the Hugging Face Hub spells repositories (and no such folder here)."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def is_builtin(model: str) -> bool:
    """True when `model` names a shipped folder (a built-in name, not a user's folder)."""
    return resolve_model(model).parent == BUILTIN_DIR


def resolve_load_format(model: str, load_format: str) -> str:
    """`load_format` with "auto" resolved: "dummy" for a built-in shape that ships no weights,
    "safetensors" for every folder that has them (a user's, or the trained kvfit-sotu)."""
    if load_format != "auto":
        return load_format
    folder = resolve_model(model)
    has_weights = any(folder.glob("*.safetensors"))
    return "dummy" if is_builtin(model) and not has_weights else "safetensors"


def load_hf_config(model: str) -> PretrainedConfig:
    """The Hugging Face config of a local folder or built-in model; nothing is downloaded.

    kvfit runs its own model code, never a folder's (`trust_remote_code` stays off): a config
    transformers cannot read (an unknown `model_type`, custom code) of an architecture kvfit
    does not run is refused as that architecture, naming the supported ones."""
    folder = resolve_model(model)
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        # Else transformers' OSError, a traceback past the CLI's one-line errors.
        raise ValueError(f"{folder / 'config.json'} is not valid JSON ({e}); the download may "
                         f"be cut short: fetch it again") from None
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except ValueError as e:
        try:
            architectures = json.loads((folder / "config.json").read_text()).get("architectures")
        except (OSError, ValueError, AttributeError):
            raise e from None
        if isinstance(architectures, list):
            model_class_for(architectures)  # raises, naming them, if kvfit runs none of them
        raise
    except Exception as e:
        # transformers 5 validates fields as it reads them and refuses a bad one with a
        # KeyError (rope_scaling without a key its rope_type needs) or huggingface_hub's
        # StrictDataclassError (a field of the wrong type, an odd head_dim): no ValueError,
        # so a traceback past the CLI's one-line errors.
        reason = " ".join(str(e).strip("'\"").split())
        raise ValueError(f"{folder / 'config.json'} is refused by transformers "
                         f"({type(e).__name__}: {reason}); correct that field") from e


def load_tokenizer(model: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a model (folder or built-in name) or of a folder holding only tokenizer
    files, local files only; None when there are no tokenizer files (the model then serves
    token-id prompts only)."""
    folder = Path(model).expanduser()
    if not (folder.is_dir() and any((folder / name).is_file() for name in _TOKENIZER_FILES)):
        folder = resolve_model(model)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    # As for the config: never a folder's own code, and never a prompt on stdin asking.
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                             trust_remote_code=False)
    except Exception as e:  # transformers and tokenizers raise many kinds for broken files
        raise ValueError(f"cannot load the tokenizer in {folder} ({type(e).__name__}: {e}); "
                         f"its files may be cut short or of another format: fetch them again, "
                         f"or pass --tokenizer FOLDER") from e


def load_eos_token_ids(model: str, hf_config: PretrainedConfig) -> list[int]:
    """The ids that end generation, as vLLM gathers them: config.json's `eos_token_id` and
    generation_config.json's (each an int, a list or absent), in that order, once each."""
    ids = [getattr(hf_config, "eos_token_id", None),
           _generation_config(resolve_model(model)).get("eos_token_id")]
    flat = [i for entry in ids if entry is not None
            for i in ([entry] if isinstance(entry, int) else entry)]
    # An id the model cannot sample never ends anything; kept, the sampler's min_tokens ban
    # (row * vocab_size + id) would index past the logits or ban another row's token.
    vocab_size = hf_config.vocab_size
    unique = list(dict.fromkeys(flat))
    if outside := [i for i in unique if not 0 <= i < vocab_size]:
        logger.warning("eos_token_id %s (config.json / generation_config.json) outside the "
                       "vocabulary (vocab_size=%d) ignored: the model cannot generate it",
                       outside, vocab_size)
    return [i for i in unique if 0 <= i < vocab_size]


# generation_config.json's sampling fields that vLLM takes as defaults, by SamplingParams name.
_SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                      "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                      "max_new_tokens": "max_tokens"}


def load_sampling_defaults(model: str, source: str = "auto") -> dict[str, Any]:
    """The sampling defaults a request that leaves a field unset takes, as vLLM's
    `--generation-config`: `"auto"` reads them from the model folder's generation_config.json,
    `"vllm"` gives none (SamplingParams' own defaults), a folder path reads its file. Only the
    fields the file sets: transformers' class defaults (top_k 50, ...) are not the model's."""
    if source == "vllm":
        return {}
    folder = resolve_model(model) if source == "auto" else Path(source)
    if source != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config={source!r} is neither 'auto', 'vllm' nor a "
                         f"folder; pass a folder holding generation_config.json")
    if source != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config={source!r}: {folder} holds no "
                         f"generation_config.json")
    raw = _generation_config(folder)
    return {name: raw[key] for key, name in _SAMPLING_DEFAULTS.items()
            if raw.get(key) is not None}


def _generation_config(folder: Path) -> dict[str, Any]:
    """`folder`'s generation_config.json as a dict ({} where there is none)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a JSON object: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object: it holds {type(raw).__name__}")
    return raw


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    hf_config: PretrainedConfig,
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
) -> nn.Module:
    """Build the model for `hf_config` on `device` in `dtype` and fill its weights; eval mode.

    `load_format`: "safetensors" reads the folder's `*.safetensors` (single or sharded with
    `model.safetensors.index.json`) straight to the device; "dummy" gives seeded random weights
    at the real shapes; "auto" is "dummy" for built-in shapes that ship no weights and
    "safetensors" otherwise (`resolve_load_format`).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if (load_format == "safetensors" and is_builtin(model)
            and resolve_load_format(model, "auto") == "dummy"):
        raise ValueError(f"built-in model {model!r} has no weights; use load_format='dummy'")
    model_class = get_model_class(hf_config)
    device = torch.device(device)
    # Parameters are created on the device in their final dtype: weights are never held twice.
    with torch.device(device), _default_dtype(dtype):
        module = model_class(hf_config)
    fill_weights(module, model, device, load_format)
    return module.eval()


def fill_weights(module: nn.Module, model: str, device: torch.device, load_format: str) -> None:
    """Fill `module`'s parameters in place from `model`'s source (`load_model`'s
    `load_format`): the checkpoint, or the same seeded dummy values every time. Sleep level 2
    reloads through this, into the addresses the parameters already have."""
    if resolve_load_format(model, load_format) == "dummy":
        init_dummy(module)
    else:
        load_safetensors(module, resolve_model(model), torch.device(device))
