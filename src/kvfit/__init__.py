"""kvfit: an LLM inference engine whose KV cache is sized from measured memory.

`LLM` and `SamplingParams` are imported lazily so that `import kvfit.vmm` (or `kvfit probe`)
does not pay for the engine, transformers or tokenizers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kvfit.engine.llm import LLM
    from kvfit.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvfit.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvfit.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvfit' has no attribute {name!r}")
