"""Gumbel-max sampling: the torch path on the CPU, the Triton kernel through the interpreter
(tiny shapes, fp32) and on the GPU (bf16, Qwen3's vocabulary).

    python3 -m pytest tests/ops/test_triton_sampling.py -q
    TRITON_INTERPRET=1 python3 -m pytest tests/ops/test_triton_sampling.py -q
    PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_triton_sampling.py -q

Every draw is seeded, so each test is deterministic; the statistical bounds are wide (4.5
standard errors) and fail only on a biased sampler.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvfit.ops.sampling import gumbel_sample, gumbel_sample_torch

try:  # Triton is optional (the `cuda` and `dev` extras): the torch path's tests run without it.
    import triton
    import triton.language as tl

    from kvfit.ops import triton_sampling
except ImportError:
    triton = tl = triton_sampling = None

INF = float("inf")
SMALL_LOGITS = [0.0, 1.0, 2.0, -1.0, -INF, 0.5, 3.0, -2.0]  # a masked token among them
MAX_Z = 4.5
QWEN3_VOCAB = 151936

interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py



def _triton_sample(logits, temperature, seeds, **knobs) -> torch.Tensor:
    # A tile smaller than the tiny test vocabularies, so rows span several tiles and splits.
    return triton_sampling.gumbel_sample_triton(logits, temperature, seeds, **{"block": 8, **knobs})


# The torch path runs everywhere; the kernel only under the interpreter, which runs each program
# in Python (~10 ms), so it gets fewer rows for the statistical test.
IMPLS = [
    pytest.param(gumbel_sample_torch, 4000, id="torch"),
    pytest.param(_triton_sample, 300, id="triton", marks=interpret),
]


def _batch(row: list[float] | torch.Tensor, n: int, temperature: float, device: str = "cpu"):
    logits = torch.as_tensor(row, dtype=torch.float32, device=device).expand(n, -1)
    return logits, torch.full((n,), temperature, device=device), torch.arange(n, device=device)


def assert_matches_softmax(tokens: torch.Tensor, logits: torch.Tensor, temperature: float):
    """Each token's empirical frequency is within MAX_Z standard errors of softmax(logits / T);
    tokens of probability 0 are never drawn."""
    probs = (logits.double() / temperature).softmax(-1).cpu()
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    n = tokens.numel()
    assert counts[probs == 0].sum() == 0
    seen = probs > 0
    z = (counts[seen] / n - probs[seen]) / (probs[seen] * (1 - probs[seen]) / n).sqrt()
    assert z.abs().max() < MAX_Z, f"frequencies {counts / n} vs softmax {probs}"


def _masked_logits(num_rows: int, vocab_size: int, allowed: int, device: str = "cpu"):
    """Logits where the masked tokens (-inf) had the largest values and each row keeps
    `allowed` low-valued tokens: a sampler that let masked tokens through would pick them."""
    gen = torch.Generator(device).manual_seed(1)
    logits = torch.rand(num_rows, vocab_size, generator=gen, device=device) + 10.0
    keep = torch.rand(num_rows, vocab_size, generator=gen, device=device).argsort(-1)[:, :allowed]
    kept = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    kept.scatter_(1, keep, True)
    logits[kept] = -10.0 * torch.rand(int(kept.sum()), generator=gen, device=device)
    return logits.masked_fill(~kept, -INF), kept


# --- torch path and interpreted kernel ---------------------------------------------------------


@pytest.mark.parametrize("sample,num_rows", IMPLS)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_softmax_of_logits_over_temperature(sample, num_rows, temperature):
    logits, temperatures, seeds = _batch(SMALL_LOGITS, num_rows, temperature)
    tokens = sample(logits, temperatures, seeds)
    assert tokens.dtype == torch.int64 and tokens.shape == (num_rows,)
    assert_matches_softmax(tokens, logits[0], temperature)


@pytest.mark.parametrize("sample,num_rows", IMPLS)
def test_masked_tokens_never_win(sample, num_rows):
    logits, kept = _masked_logits(64, 50, allowed=3)
    # A high temperature flattens the allowed tokens; masked ones must still lose.
    tokens = sample(logits, torch.full((64,), 20.0), torch.arange(64))
    assert kept.gather(1, tokens[:, None]).all()


@pytest.mark.parametrize("sample,num_rows", IMPLS)
def test_fully_masked_row_gives_a_valid_index(sample, num_rows):
    logits = torch.randn(3, 21)
    logits[1] = -INF
    tokens = sample(logits, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([4, 5, 6]))
    assert 0 <= tokens[1] < 21
    assert tokens[2] == logits[2].argmax()


@pytest.mark.parametrize("sample,num_rows", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zero_temperature_is_argmax_with_first_index_ties(sample, num_rows, dtype):
    logits = torch.randint(0, 3, (16, 37)).to(dtype)  # many ties
    tokens = sample(logits, torch.zeros(16), torch.arange(16))
    torch.testing.assert_close(tokens, logits.argmax(-1), rtol=0, atol=0)


@pytest.mark.parametrize("sample,num_rows", IMPLS)
def test_vanishing_temperature_takes_the_argmax(sample, num_rows):
    """A temperature so small that 1 / T (or a logit / T) overflows float32 still samples
    softmax(logits / T), which is all on the argmax: not the first column whose score became
    inf (the first positive logit)."""
    logits = torch.tensor([-3.0, 0.5, -1.0, 2.5, 1.0] * 3).expand(4, -1)
    temperature = torch.tensor([1e-30, 1e-38, 1e-40, 1e-45])
    tokens = sample(logits, temperature, torch.arange(4))
    assert tokens.tolist() == [3] * 4


@pytest.mark.parametrize("sample,num_rows", IMPLS)
def test_token_depends_only_on_seed_and_logits(sample, num_rows):
    logits = torch.randn(12, 37) * 0.1  # near-flat: the noise decides
    temperatures = torch.full((12,), 1.5)
    seeds = torch.arange(12) * 1000 - 3  # includes a negative (two's-complement) seed
    tokens = sample(logits, temperatures, seeds)
    torch.testing.assert_close(sample(logits, temperatures, seeds), tokens, rtol=0, atol=0)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    permuted = sample(logits[perm], temperatures[perm], seeds[perm])
    torch.testing.assert_close(permuted, tokens[perm], rtol=0, atol=0)
    alone = sample(logits[5:6], temperatures[5:6], seeds[5:6])
    assert alone.item() == tokens[5]
    # Other seeds, other draws (12 rows over 37 near-equally likely tokens cannot all agree).
    assert (sample(logits, temperatures, seeds + 1) != tokens).any()


def test_dispatch_takes_the_torch_path_on_cpu():
    logits, temperatures, seeds = _batch(SMALL_LOGITS, 50, 1.0)
    torch.testing.assert_close(
        gumbel_sample(logits, temperatures, seeds),
        gumbel_sample_torch(logits, temperatures, seeds),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize(
    "change,setting",
    [
        (dict(logits=torch.zeros(4)), "logits"),
        (dict(logits=torch.zeros(2, 0)), "logits"),
        (dict(logits=torch.zeros(2, 5, dtype=torch.float64)), "logits dtype"),
        (dict(temperature=torch.ones(3)), "temperature"),
        (dict(temperature=torch.ones(2, dtype=torch.float64)), "temperature"),
        (dict(seeds=torch.arange(2, dtype=torch.int32)), "seeds"),
    ],
)
def test_bad_input_names_the_setting(change, setting):
    args = dict(logits=torch.zeros(2, 5), temperature=torch.ones(2), seeds=torch.arange(2))
    with pytest.raises(ValueError, match=setting):
        gumbel_sample(**{**args, **change})


# --- interpreted kernel only -------------------------------------------------------------------


@interpret
def test_kernel_result_does_not_depend_on_tiling():
    logits = torch.randn(5, 203)  # 203: not a multiple of any tile
    logits[2, ::3] = -INF
    temperatures = torch.tensor([1.0, 0.7, 2.0, 0.0, 1.0])
    seeds = torch.tensor([0, 1, 2**62, -(2**63), 7])
    expect = _triton_sample(logits, temperatures, seeds, num_splits=1)
    for knobs in (dict(num_splits=3), dict(block=32, num_splits=2), dict(block=256)):
        got = _triton_sample(logits, temperatures, seeds, **knobs)
        torch.testing.assert_close(got, expect, rtol=0, atol=0, msg=str(knobs))


@interpret
def test_kernel_reads_strided_rows():
    wide = torch.randn(4, 2, 45)
    logits = wide[:, 1, 3:40]  # row stride 90, 37 columns
    args = (torch.full((4,), 0.8), torch.arange(4))
    expect = _triton_sample(logits.contiguous(), *args)
    torch.testing.assert_close(_triton_sample(logits, *args), expect, rtol=0, atol=0)


if triton is not None:

    @triton.jit
    def _noise_kernel(out, seed, BLOCK: tl.constexpr):
        counter = tl.arange(0, BLOCK // 4)[:, None]
        j = tl.arange(0, 4)[None, :]
        tl.store(out + 4 * counter + j, triton_sampling._gumbel(seed, counter, j, False))


@interpret
def test_kernel_noise_is_gumbel_out_to_its_tail():
    """The noise of 2**16 columns against Gumbel(0, 1): the Kolmogorov-Smirnov distance, and
    the counts of draws above 4 and 8, the tail that decides which tokens win."""
    n = 2**16
    noise = torch.empty(n)
    _noise_kernel[(1,)](noise, 12345, BLOCK=n)
    noise = noise.double() * math.log(2)  # the kernel works in base 2
    assert torch.isfinite(noise).all()
    cdf = torch.exp(-torch.exp(-noise.sort().values))
    ks = (cdf - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max()
    assert ks < 1.63 / math.sqrt(n)  # the 1% critical value
    for threshold in (4.0, 8.0):
        expected = n * -math.expm1(-math.exp(-threshold))  # n * P(g > threshold)
        assert abs((noise > threshold).sum().item() - expected) < MAX_Z * math.sqrt(expected) + 1


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [256, 1])
def test_gpu_masking_greedy_and_determinism(num_rows):
    sample = triton_sampling.gumbel_sample_triton
    logits, kept = _masked_logits(num_rows, QWEN3_VOCAB, allowed=8, device="cuda")
    logits = logits.bfloat16()
    gen = torch.Generator("cuda").manual_seed(2)
    temperatures = torch.rand(num_rows, generator=gen, device="cuda") * 2 + 0.1
    temperatures[::4] = 0.0  # greedy rows in the same batch
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=gen, device="cuda")
    tokens = gumbel_sample(logits, temperatures, seeds)
    assert kept.gather(1, tokens[:, None]).all()
    greedy = temperatures == 0
    torch.testing.assert_close(tokens[greedy], logits[greedy].float().argmax(-1), rtol=0, atol=0)
    for knobs in (dict(), dict(num_splits=1), dict(num_splits=7), dict(block=4096, num_warps=8)):
        again = sample(logits, temperatures, seeds, **knobs)
        torch.testing.assert_close(again, tokens, rtol=0, atol=0, msg=str(knobs))
    last = num_rows - 1
    alone = sample(logits[last:], temperatures[last:], seeds[last:])
    assert alone.item() == tokens[last].item()


@pytest.mark.gpu
def test_gpu_fully_masked_rows_and_distinct_seeds():
    logits = torch.zeros(256, QWEN3_VOCAB, dtype=torch.bfloat16, device="cuda")
    seeds = torch.arange(256, device="cuda")
    tokens = gumbel_sample(logits, torch.ones(256, device="cuda"), seeds)
    # Uniform over 151,936 tokens: 256 independent draws repeat about 0.2 times on average.
    assert tokens.unique().numel() >= 250
    masked = gumbel_sample(logits - INF, torch.ones(256, device="cuda"), seeds)
    assert ((masked >= 0) & (masked < QWEN3_VOCAB)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_gpu_small_vocab_matches_softmax(temperature):
    logits, temperatures, seeds = _batch(SMALL_LOGITS, 200_000, temperature, device="cuda")
    tokens = gumbel_sample(logits.bfloat16(), temperatures, seeds)
    assert_matches_softmax(tokens, logits[0].bfloat16().float(), temperature)


@pytest.mark.gpu
def test_gpu_full_vocab_matches_softmax():
    """One bf16 row of Qwen3's vocabulary drawn 20,000 times (a stride-0 batch): frequencies of
    the top tokens and of probability buckets over the whole tail match softmax(logits / T)."""
    num_rows, temperature = 20_000, 0.8
    row = (torch.randn(QWEN3_VOCAB, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    logits = row.cuda().expand(num_rows, -1)
    tokens = gumbel_sample(
        logits, torch.full((num_rows,), temperature, device="cuda"),
        torch.arange(num_rows, device="cuda"),
    )  # fmt: skip
    probs = (row.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    # Buckets: the 8 likeliest tokens alone, then the rest in 8 slices of about equal mass.
    rest = torch.bucketize(probs[order[8:]].cumsum(0) / probs[order[8:]].sum(),
                           torch.linspace(0, 1, 9)[1:-1].double())  # fmt: skip
    bucket = torch.empty(QWEN3_VOCAB, dtype=torch.int64)
    bucket[order[:8]] = torch.arange(8)
    bucket[order[8:]] = 8 + rest
    bucket_probs = torch.zeros(16, dtype=torch.float64).index_add_(0, bucket, probs)
    assert_matches_softmax(bucket[tokens.cpu()], bucket_probs.log(), 1.0)
