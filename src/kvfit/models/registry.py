"""Hugging Face architecture name (config field `architectures`) -> kvfit model class."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from kvfit.models.llama import LlamaForCausalLM
from kvfit.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The class for the first supported entry of `hf_config.architectures`."""
    return model_class_for(getattr(hf_config, "architectures", None) or [])


def model_class_for(architectures: list[str]) -> type[nn.Module]:
    """The class for the first supported entry of `architectures` (config.json's field)."""
    for name in architectures:
        if name in MODELS:
            return MODELS[name]
    raise ValueError(
        f"unsupported architecture {architectures or 'none'} (config.json field "
        f"`architectures`); kvfit supports: {', '.join(MODELS)}"
    )
