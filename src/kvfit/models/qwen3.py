"""Qwen3 (dense): the Llama decoder plus an RMSNorm over each q and k head before rope."""

from __future__ import annotations

from kvfit.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM. Its checkpoints carry `q_norm`/`k_norm` weights and no q/k/v bias
    (`attention_bias` false), which the shared Llama body reads from the config."""

    qk_norm = True
