"""kvfit's models against Hugging Face transformers on the same weights, over a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from kvfit.models.llama import head_dim
from kvfit.models.loader import load_hf_config, load_model
from kvfit.ops.attention import AttentionMetadata

ARCHS = ("qwen3", "llama")


class PagedRunner:
    """A minimal model runner: per-sequence block tables over plain KV cache tensors.

    Blocks are handed out in a shuffled order so that block tables are not contiguous.
    """

    def __init__(
        self, model: nn.Module, config: PretrainedConfig, num_blocks: int = 64, block_size: int = 4
    ) -> None:
        param = next(model.parameters())
        shape = (num_blocks, block_size, config.num_key_value_heads, head_dim(config))
        self.kv_caches = [
            (param.new_zeros(shape), param.new_zeros(shape))
            for _ in range(config.num_hidden_layers)
        ]
        model.bind_kv_cache(self.kv_caches)
        self.model, self.block_size, self.device = model, block_size, param.device
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
        self.free_blocks = order.tolist()
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append `chunks[seq]` to each sequence's context in one packed batch; returns each
        sequence's logits for its new tokens, [len(chunk), vocab]."""
        input_ids, positions, slots, query_start_loc, seq_lens, tables = [], [], [], [0], [], []
        for seq, tokens in chunks.items():
            start = self.seq_lens.get(seq, 0)
            end = self.seq_lens[seq] = start + len(tokens)
            table = self.block_tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                block, offset = divmod(pos, self.block_size)
                positions.append(pos)
                slots.append(table[block] * self.block_size + offset)
            input_ids += tokens
            query_start_loc.append(query_start_loc[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(table)
        width = max(len(t) for t in tables)
        device, i32 = self.device, torch.int32
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=i32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=i32, device=device),
            block_table=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=i32, device=device
            ),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, device=device),
                torch.tensor(positions, device=device),
                metadata,
            )
            logits = self.model.compute_logits(hidden).float()
        return dict(zip(chunks, logits.split([len(t) for t in chunks.values()]), strict=True))


def random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def load_pair(
    folder: Path, dtype: torch.dtype, device: str
) -> tuple[nn.Module, nn.Module, PretrainedConfig]:
    config = load_hf_config(str(folder))
    ours = load_model(config, str(folder), dtype, torch.device(device), "safetensors")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    return ours, hf.to(device).eval(), config


def hf_logits(hf: nn.Module, tokens: list[int]) -> torch.Tensor:
    device = next(hf.parameters()).device
    with torch.inference_mode():
        return hf(torch.tensor([tokens], device=device)).logits[0].float()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]):
    return load_pair(tiny_model(request.param), torch.float32, "cpu")


def test_packed_prefill_matches_hf(pair) -> None:
    ours, hf, config = pair
    prompts = {
        0: random_tokens(7, 1),
        1: random_tokens(33, 2),
        2: random_tokens(1, 3),
        3: random_tokens(18, 4),
    }
    logits = PagedRunner(ours, config).step(prompts)
    for seq, prompt in prompts.items():
        torch.testing.assert_close(logits[seq], hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_cached_prefix_then_decode_matches_hf(pair) -> None:
    """Chunked prefill over a cached prefix, mixed with another sequence's decode steps."""
    ours, hf, config = pair
    full = {0: random_tokens(40, 5), 1: random_tokens(12, 6)}
    runner = PagedRunner(ours, config)
    steps = [
        {0: full[0][:13], 1: full[1][:9]},  # prefills
        {0: full[0][13:34], 1: full[1][9:10]},  # a prefill chunk after a cached prefix + a decode
        *({0: full[0][i : i + 1], 1: full[1][i - 24 : i - 23]} for i in range(34, 36)),
        *({0: full[0][i : i + 1]} for i in range(36, 40)),  # decode of one sequence alone
    ]
    expected = {seq: hf_logits(hf, tokens) for seq, tokens in full.items()}
    for chunks in steps:
        logits = runner.step(chunks)
        for seq in chunks:
            end = runner.seq_lens[seq]
            got, want = logits[seq], expected[seq][end - len(chunks[seq]) : end]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert runner.seq_lens == {0: 40, 1: 12}


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 4.0},
])
def test_scaled_ropes_match_hf_past_max_position_embeddings(tmp_path: Path,
                                                            scaling: dict) -> None:
    """YaRN's context is original_max_position_embeddings x factor and linear scaling's
    max_position_embeddings x factor, which may pass max_position_embeddings (Qwen3: 32768 x
    4 against 40960); transformers ropes any position, and kvfit's rotary table ended at
    max_position_embeddings (an index error past it)."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=40,
        initializer_range=0.1, rope_scaling=scaling,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    ours, hf, config = load_pair(tmp_path, torch.float32, "cpu")
    tokens = random_tokens(110, 12)
    runner = PagedRunner(ours, config)
    got = torch.cat([runner.step({0: tokens[:100]})[0], runner.step({0: tokens[100:]})[0]])
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_dummy_weights_are_deterministic_and_finite() -> None:
    config = load_hf_config("kvfit-tiny")
    first, second = (
        load_model(config, "kvfit-tiny", torch.float32, torch.device("cpu"), "auto")
        for _ in range(2)
    )
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    logits = PagedRunner(first, config).step({0: random_tokens(20, 7), 1: [5]})
    assert all(torch.isfinite(t).all() for t in logits.values())
    assert logits[0].shape == (20, config.vocab_size)


def test_bind_kv_cache_checks_layer_count(pair) -> None:
    ours, _, config = pair
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ours.bind_kv_cache([(torch.empty(0), torch.empty(0))] * (config.num_hidden_layers + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_cuda_matches_hf_top5(arch: str, tiny_model: Callable[[str], Path]) -> None:
    """bf16 on the GPU (Triton kernels): at every position each side's top-1 token is in the
    other side's top-5, and the log-probabilities stay close."""
    ours, hf, config = load_pair(tiny_model(arch), torch.bfloat16, "cuda")
    full = {0: random_tokens(70, 8), 1: random_tokens(25, 9), 2: random_tokens(6, 10)}
    runner = PagedRunner(ours, config, num_blocks=128, block_size=16)
    got = runner.step({seq: tokens[:-4] for seq, tokens in full.items()})
    for i in range(4, 0, -1):
        step = runner.step({seq: tokens[-i:][:1] for seq, tokens in full.items()})
        got = {seq: torch.cat([got[seq], step[seq]]) for seq in full}
    for seq, tokens in full.items():
        ours_lp, hf_lp = got[seq].log_softmax(-1), hf_logits(hf, tokens).log_softmax(-1)
        ours_top5, hf_top5 = ours_lp.topk(5).indices, hf_lp.topk(5).indices
        assert (ours_top5[:, :1] == hf_top5).any(-1).all()
        assert (hf_top5[:, :1] == ours_top5).any(-1).all()
        assert (ours_lp - hf_lp).abs().mean() < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-0.6b-shape", "qwen3-8b-shape"])
def test_dummy_real_shapes_give_finite_bf16_logits(name: str) -> None:
    config = load_hf_config(name)
    model = load_model(config, name, torch.bfloat16, torch.device("cuda"), "auto")
    runner = PagedRunner(model, config, num_blocks=32, block_size=16)
    prompts = {
        0: random_tokens(300, 11, config.vocab_size),
        1: random_tokens(1, 12, config.vocab_size),
    }
    logits = runner.step(prompts)
    logits |= runner.step({0: [7], 1: [8]})
    assert all(torch.isfinite(t).all() for t in logits.values())


def test_small_batch_path_runs_its_fused_layers_and_matches(pair, monkeypatch) -> None:
    """The small-batch wiring, on the CPU where its ops are the torch compositions (so the
    logits must match bit for bit): under the switch a one-token decode runs every norm inside
    the projection after it and the SiLU inside down_proj, a 9-token prefill the plain skinny
    product, and the batch-invariant mode none of them."""
    from kvfit.batch_invariant import batch_invariant_mode
    from kvfit.models import parallel_layers
    from kvfit.ops import small_batch

    ours, _, config = pair
    calls: dict[str, int] = {}

    def counted(name: str, fn: Callable) -> Callable:
        def spy(*args, **kwargs):  # noqa: ANN202
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return spy

    for name in ("skinny_linear", "rms_norm_linear", "silu_and_mul_linear"):
        monkeypatch.setattr(parallel_layers, name, counted(name, getattr(parallel_layers, name)))
    # The CPU tensors stand in for CUDA ones: the row bounds decide.
    monkeypatch.setattr(parallel_layers, "takes_skinny_path", lambda x: (
        small_batch.is_small_batch_enabled() and 0 < x.shape[0] <= small_batch.MAX_ROWS))
    monkeypatch.setattr(parallel_layers, "fuses_prologue", lambda x: (
        small_batch.is_small_batch_enabled() and 0 < x.shape[0] <= small_batch.FUSED_MAX_ROWS))
    prompt = random_tokens(9, 7)
    steps = [{0: prompt}, {0: [5]}, {0: [6]}]
    default = PagedRunner(ours, config)
    expected = [default.step(s)[0] for s in steps]
    skinny = PagedRunner(ours, config)
    layers = config.num_hidden_layers
    with small_batch.small_batch_kernels():
        assert torch.equal(skinny.step(steps[0])[0], expected[0])
        assert calls == {"skinny_linear": 4 * layers + 1}  # qkv, o, gate_up, down; LM head
        calls.clear()
        assert torch.equal(skinny.step(steps[1])[0], expected[1])
        assert calls == {"rms_norm_linear": 2 * layers, "silu_and_mul_linear": layers,
                         "skinny_linear": layers + 1}  # o_proj, the LM head
        calls.clear()
        with batch_invariant_mode():
            skinny.step(steps[2])
        assert calls == {}
