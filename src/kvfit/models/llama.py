"""Llama (2 and 3) decoder over the paged KV cache: the dense body every kvfit model shares."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from kvfit.batch_invariant.functional import paged_attention, silu_and_mul
from kvfit.distributed import tp_size
from kvfit.kv_quant import calculate_kv_scales_, checkpoint_scale
from kvfit.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_shard,
    kv_head_shard,
    small_batch_attention_input,
    small_batch_fused,
)
from kvfit.ops.attention import AttentionMetadata
from kvfit.ops.attention_input import (
    AttentionInputArgs,
    attention_input,
    decode_attention,
    fuses_decode_input,
    stored_key,
)
from kvfit.ops.layers import ROPE_TYPES, RotaryEmbedding, add_rms_norm, rms_norm, rope_positions


def head_dim(config: PretrainedConfig) -> int:
    """Per-head width: `head_dim` when the config sets it, else hidden_size / num_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: PretrainedConfig) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either spelling of the config.

    transformers 5 folds both into `rope_parameters` (theta inside); 4.x has top-level
    `rope_theta` and an optional `rope_scaling`.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    # Older configs say "type" where newer ones say "rope_type".
    params["rope_type"] = params.pop("type", None) or params.get("rope_type", "default")
    return float(theta), None if params["rope_type"] == "default" else params


def max_positions(config: PretrainedConfig) -> int:
    """The longest sequence the model runs: `max_position_embeddings`, or longer under YaRN
    (`kvfit.ops.layers.rope_positions`); its rotary table holds that many positions."""
    return rope_positions(config.max_position_embeddings, rope_parameters(config)[1])


def check_config(config: PretrainedConfig, max_model_len: int) -> None:
    """Raise ValueError naming the config.json field of a feature the Llama body (and so
    Qwen3) does not implement, rather than run it and generate something else than
    transformers would."""
    if config.hidden_act != "silu":
        raise ValueError(f"config.json hidden_act {config.hidden_act!r} is not supported "
                         f"(only 'silu')")
    _, scaling = rope_parameters(config)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json rope_scaling rope_type {rope_type!r} is not supported; "
                         f"kvfit supports {', '.join(ROPE_TYPES)}")
    dim = head_dim(config)
    if dim % 2:
        source = "" if getattr(config, "head_dim", None) else (
            f" (hidden_size {config.hidden_size} / num_attention_heads "
            f"{config.num_attention_heads})")
        raise ValueError(f"config.json head_dim {dim}{source} is odd; rope rotates the two "
                         f"halves of a head, so head_dim must be even")
    params = getattr(config, "rope_parameters", None) or {}
    partial = (params.get("partial_rotary_factor")
               or getattr(config, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {partial} is not supported "
                         f"(rope over the whole head only)")
    # Qwen3 names its sliding-window layers (transformers 4.53+); older configs only say
    # use_sliding_window. A window as long as the context attends to everything anyway.
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in layer_types or (
        not layer_types and getattr(config, "use_sliding_window", False))
    if sliding and window is not None and max_model_len > window:
        raise ValueError(f"config.json turns on sliding-window attention (sliding_window="
                         f"{window}), which kvfit does not implement: lower max_model_len to "
                         f"{window} or less, where it attends to every token anyway")
    kinds = set(layer_types) - {"full_attention", "sliding_attention"}
    if kinds:
        raise ValueError(f"config.json layer_types holds {sorted(kinds)}; kvfit runs "
                         f"full attention only")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with a residual `(norm(x + residual), x + residual)` in one pass."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    """GQA attention that writes this step's K/V into its cache, then attends over the pages.

    Tensor parallel: each rank runs its share of the query heads and of the KV heads (or a
    copy of the one KV head they read), and `o_proj` sums the ranks' parts.
    """

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim(config)
        self.num_heads = total_heads // tp_size()
        self.num_kv_heads = max(1, total_kv_heads // tp_size())
        self.scale = self.head_dim**-0.5
        q_size = total_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        kv = kv_head_shard(total_kv_heads, self.head_dim)
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size, {"q_proj": even_shard(q_size), "k_proj": kv, "v_proj": kv}, bias
        )
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=bias)
        # Qwen3 normalises each q and k head (before rope); Llama does not.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb
        # Bound by `bind_kv_cache`; plain attributes so they stay out of the state dict.
        self.k_cache = self.v_cache = torch.empty(0)
        # An FP8 cache's scales (`kvfit.kv_quant.scales`: 1.0 unless calculated); read on the
        # device by the kernels, so graphs see a calculated value. Not in the state dict.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.calculate_kv_scales = False  # set for the one step that calculates them
        # The checkpoint's k/v scales, "k"/"v" -> (tensor name, value on the host), as loaded
        # (`kvfit.models.weights`); `use_checkpoint_kv_scales` makes them the cache's.
        self.checkpoint_kv_scales: dict[str, tuple[str, torch.Tensor]] = {}

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        q = self.project(positions, hidden, attn_metadata.slot_mapping)
        return self.o_proj(self.attend(q, attn_metadata).flatten(1))

    def project(
        self, positions: torch.Tensor, hidden: torch.Tensor, slot_mapping: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H] -> q [T, heads, head_dim]: the QKV projection, q/k norms, rope and the
        K/V store at `slot_mapping`. Reads no host bound of the step, so it is graph safe at
        any batch composition of T tokens (piecewise graphs capture it)."""
        return self.project_qkv(positions, self.qkv_proj(hidden), slot_mapping)

    def fuses_decode_input(self, attn_metadata: AttentionMetadata) -> bool:
        """Whether this step's attention runs as `decode` (`fuses_decode_input`); never in the
        step that calculates the K/V scales, which reads k before the store."""
        return not self.calculate_kv_scales and fuses_decode_input(self.k_cache, attn_metadata)

    def decode(self, positions: torch.Tensor, qkv: torch.Tensor,
               attn_metadata: AttentionMetadata) -> torch.Tensor:
        """`project_qkv` and `attend` of a step of decode rows in one op (`decode_attention`):
        on CUDA the attention input, and the split reduction where the metadata holds
        `split_tickets`, ride in the decode kernel: up to two graph nodes fewer a layer."""
        q, k, v = self._heads(qkv)
        return decode_attention(
            positions, q, k, v,
            self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None,
            self.q_norm.eps if self.q_norm is not None else 0.0,
            self.rotary_emb.cos_sin_cache, self.k_cache, self.v_cache, attn_metadata, self.scale,
        )

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[T, heads, head_dim]` views of the QKV projection's output [T, q + k + v]."""
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        num_tokens = qkv.shape[0]  # not -1 in the views: T may be 0
        return (q.view(num_tokens, self.num_heads, self.head_dim),
                k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))

    def project_qkv(
        self, positions: torch.Tensor, qkv: torch.Tensor, slot_mapping: torch.Tensor
    ) -> torch.Tensor:
        """`project` from the QKV projection's output [T, q + k + v]."""
        q, k, v = self._heads(qkv)
        if self.calculate_kv_scales:
            self._calculate_kv_scales(positions, k, v)
        # q/k norms (Qwen3), rope and the K/V store in one launch: on CUDA, one kernel node
        # instead of four in every layer of the decode graphs, and 3 fewer Triton launches per
        # layer of an eager prefill step, whose host time is mostly such launches.
        return attention_input(positions, q, k, v, *self._input_operands(slot_mapping))

    def attention_input_args(self, positions: torch.Tensor,
                             slot_mapping: torch.Tensor) -> AttentionInputArgs:
        """This layer's `attention_input` arguments but q, k and v."""
        return AttentionInputArgs(positions, *self._input_operands(slot_mapping))

    def _input_operands(self, slot_mapping: torch.Tensor) -> tuple:
        """`attention_input`'s arguments after q, k and v: a tuple, which every eager step
        builds for every layer (a dataclass took ~1.3 us more a layer)."""
        norm = self.q_norm
        return (norm.weight if norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                norm.eps if norm is not None else 0.0, self.rotary_emb.cos_sin_cache,
                self.k_cache, self.v_cache, slot_mapping, self.k_scale, self.v_scale)

    def attend(self, q: torch.Tensor, attn_metadata: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Paged attention of `q` [T, heads, head_dim] over this layer's cache (into `out`)."""
        return paged_attention(q, self.k_cache, self.v_cache, attn_metadata, self.scale, out,
                               k_scale=self.k_scale, v_scale=self.v_scale)

    def _calculate_kv_scales(self, positions: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor) -> None:
        """Set the scales from this step's K (as stored: normed, rotated) and V."""
        norm = self.k_norm
        key = stored_key(positions, k, norm.weight if norm is not None else None,
                         norm.eps if norm is not None else 0.0, self.rotary_emb.cos_sin_cache)
        calculate_kv_scales_(self.k_scale, self.v_scale, key, v)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        size, bias = config.intermediate_size, getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, {"gate_proj": even_shard(size), "up_proj": even_shard(size)}, bias
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if small_batch_fused(gate_up):
            return self.down_proj.forward_silu_and_mul(gate_up)
        return self.down_proj(silu_and_mul(gate_up))

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(self(norm(x + residual)), x + residual)` with the norm in gate_up's kernel and the
        SiLU in down's (`small_batch_fused` inputs only)."""
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm.weight, norm.eps)
        return self.down_proj.forward_silu_and_mul(gate_up), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next norm adds the two,
        so each residual add rides in the norm kernel after it. `residual` is None in layer 0."""
        attn = self.self_attn
        if attn.fuses_decode_input(attn_metadata):
            qkv, residual = self.qkv(hidden, residual)
            return self.post_attention(attn.decode(positions, qkv, attn_metadata), residual)
        q, residual = self.pre_attention(positions, hidden, residual, attn_metadata.slot_mapping)
        return self.post_attention(attn.attend(q, attn_metadata), residual)

    def pre_attention(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q of this layer, the residual stream): `qkv`, then `LlamaAttention.project_qkv`;
        on the small-batch path with the QKV epilogue, both in the projection's kernel."""
        attn = self.self_attn
        if small_batch_attention_input(hidden, attn.head_dim) and not attn.calculate_kv_scales:
            args = attn.attention_input_args(positions, slot_mapping)
            if small_batch_fused(hidden):
                norm = self.input_layernorm
                return attn.qkv_proj.forward_attention_input(
                    hidden, args, (residual, norm.weight, norm.eps))
            hidden, residual = self.input_norm(hidden, residual)
            return attn.qkv_proj.forward_attention_input(hidden, args)[0], residual
        qkv, residual = self.qkv(hidden, residual)
        return attn.project_qkv(positions, qkv, slot_mapping), residual

    def qkv(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the QKV projection of the input norm's output, the residual stream); for a few rows
        under the small-batch kernels, the norm inside the QKV projection."""
        qkv_proj = self.self_attn.qkv_proj
        if small_batch_fused(hidden):
            norm = self.input_layernorm
            return qkv_proj.forward_normed(hidden, residual, norm.weight, norm.eps)
        hidden, residual = self.input_norm(hidden, residual)
        return qkv_proj(hidden), residual

    def input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input norm of hidden + residual, hidden + residual); in layer 0, which has no
        residual yet, (the norm of hidden, hidden)."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream) from the attention output [T, heads, head_dim]."""
        hidden = self.self_attn.o_proj(attn_out.flatten(1))
        if small_batch_fused(hidden):
            return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        theta, scaling = rope_parameters(config)
        # One table shared by all layers.
        rotary_emb = RotaryEmbedding(
            head_dim(config), config.max_position_embeddings, theta, scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary_emb, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]

    def piece(
        self, i: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Piece `i` of the forward split at its attention calls (piecewise CUDA graphs):
        piece 0 embeds `x` (input ids); piece i > 0 takes layer i - 1's attention output `x`
        [T, heads, head_dim] through its o_proj, norm and MLP. Every piece but the last ends
        with layer i's input norm and projection, returning (q of layer i, residual); the last
        returns (the final hidden states, None). `forward` equals the pieces with each layer's
        `attend` between them."""
        if i == 0:
            return self.layers[0].pre_attention(positions, self.embed_tokens(x), None,
                                                slot_mapping)
        hidden, residual = self.layers[i - 1].post_attention(x, residual)
        if i == len(self.layers):
            return self.norm(hidden, residual)[0], None
        return self.layers[i].pre_attention(positions, hidden, residual, slot_mapping)


class LlamaForCausalLM(nn.Module):
    """Llama causal LM over kvfit's paged KV cache.

    Parameter names follow the Hugging Face checkpoint, except that q/k/v and gate/up are fused
    (`MergedColumnParallelLinear`); `kvfit.models.weights` maps the checkpoint onto them. Under
    tensor parallelism each rank holds its slices (`parallel_layers`) and the logits are
    gathered whole on every rank.
    """

    qk_norm = False

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Tokens packed as `attn_metadata` lays them out ([T] int64 each) -> hidden [T, H]."""
        return self.model(input_ids, positions, attn_metadata)

    @property
    def num_pieces(self) -> int:
        """Pieces of the forward between attention calls (`piece`): one more than layers."""
        return len(self.model.layers) + 1

    def piece(
        self, i: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Piece `i` of `forward` (`LlamaModel.piece`): the dense work between attention calls."""
        return self.model.piece(i, x, residual, positions, slot_mapping)

    def attend(self, i: int, q: torch.Tensor, attn_metadata: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `i`'s paged attention, run between pieces `i` and `i + 1`."""
        return self.model.layers[i].self_attn.attend(q, attn_metadata, out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab_size] in the model's dtype (every rank's columns).

        Not upcast here: a float32 copy of a 1024-row prompt-logprobs chunk over a 152k
        vocabulary is 0.6 GiB, the largest transient of any step. Consumers upcast where they
        reduce (log-sum-exp, sampling), a few rows or one tile at a time.
        """
        return self.lm_head(hidden)

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give layer i the `(k_cache, v_cache)` views kv_caches[i], each
        `[num_blocks, block_size, num_kv_heads, head_dim]` (any strides)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"got KV caches for {len(kv_caches)} layers, the model has "
                f"{len(self.model.layers)} (num_hidden_layers)"
            )
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache, v_cache

    def kv_scales(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer `(k_scale, v_scale)`, the [1] float32 tensors an FP8 cache is read and
        written with (1.0 unless calculated); the same tensors every step reads."""
        return [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in self.model.layers]

    def use_checkpoint_kv_scales(self) -> None:
        """Set every layer's scales to those its checkpoint gave (`kvfit.kv_quant.scales`); a
        layer given only one of the two reads both with it, as in vLLM; a layer given none
        keeps its own."""
        for layer in self.model.layers:
            attn = layer.self_attn
            given = attn.checkpoint_kv_scales
            for which, other, scale in (("k", "v", attn.k_scale), ("v", "k", attn.v_scale)):
                entry = given.get(which) or given.get(other)
                if entry is not None:
                    scale.fill_(checkpoint_scale(*entry))

    def set_calculate_kv_scales(self, enabled: bool) -> None:
        """While enabled, each forward sets every layer's scales from its own K/V first
        (`kvfit.kv_quant.calculate_kv_scales_`), then stores them with those scales."""
        for layer in self.model.layers:
            layer.self_attn.calculate_kv_scales = enabled
