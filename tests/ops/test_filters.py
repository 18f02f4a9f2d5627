"""Top-k / top-p / min-p as per-row thresholds (`filter_thresholds`) against the sort-based
oracle (`reference.sort_filter_reference`), and Gumbel sampling under those thresholds.

    PYTHONPATH=src python3 -m pytest tests/ops/test_filters.py -q
    TRITON_INTERPRET=1 PYTHONPATH=src python3 -m pytest tests/ops/test_filters.py -q
    PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_filters.py -q

Float32 rows are tie-free, and each random top_p and min_p is moved away from the row's
boundaries (cumulative masses, probability ratios) by far more than float32 rounding, so the
kept sets must match the oracle's exactly, not almost always.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvfit.ops import filter_thresholds, gumbel_sample
from kvfit.ops.memwatch import watch_memory
from kvfit.ops.reference import sort_filter_reference
from kvfit.ops.sampling import (
    _FILTER_BYTES,
    filter_thresholds_torch,
    gumbel_sample_torch,
    key_values,
    sortable_keys,
)

try:  # Triton is optional (the `cuda` and `dev` extras): the torch path's tests run without it.
    from kvfit.ops import triton_filters, triton_sampling
except ImportError:
    triton_filters = triton_sampling = None

INF = float("inf")
QWEN3_VOCAB = 151936
MARGIN = 1e-4  # distance of top_p / min_p from the row's boundaries

_interpreted = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py


def interpret(test):
    # Greedy and unfiltered rows take log(0) and 0 * -inf on purpose; numpy warns about it.
    for mark in (_interpreted, pytest.mark.filterwarnings("ignore::RuntimeWarning")):
        test = mark(test)
    return test



# --- helpers -----------------------------------------------------------------------------------


def kept(logits: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """The finite columns at or above each row's threshold, [N, V] bool."""
    x = logits.float()
    return (x >= thresholds[:, None]) & (x > -INF)


def reference_kept(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    filtered = sort_filter_reference(logits, temperature, top_k, top_p, min_p)
    return (filtered > -INF) & (logits.float() > -INF)


def _away(value: float, boundaries: torch.Tensor, low: float, high: float) -> float:
    """`value` if no boundary is within MARGIN (relative) of it, else the nearest midpoint of
    two boundaries (or of low / high) that is."""
    if boundaries.numel() == 0:
        return value
    boundaries = boundaries.cpu()  # the helper tensors below live on the CPU
    ordered = boundaries.sort().values

    def clear(v: torch.Tensor) -> torch.Tensor:
        at = torch.searchsorted(ordered, v)
        nearest = torch.minimum((v - ordered[(at - 1).clamp_min(0)]).abs(),
                                (ordered[at.clamp_max(ordered.numel() - 1)] - v).abs())
        return nearest > MARGIN * v

    if clear(torch.tensor([value], dtype=torch.float64)):
        return value
    edges = torch.cat([torch.tensor([low, high], dtype=torch.float64),
                       boundaries.clamp(low, high)]).unique()  # fmt: skip
    mids = (edges[1:] + edges[:-1]) / 2
    mids = mids[clear(mids)]
    assert mids.numel(), f"no value in [{low}, {high}] is clear of the boundaries"
    return float(mids[(mids - value).abs().argmin()])


def safe_filters(logits, temperature, top_k, top_p, min_p):
    """top_p and min_p clear of each row's boundaries, found in float64: min_p of the
    probability ratios p_i / max(p), top_p of the cumulative renormalised masses of S."""
    x = logits.double()
    top_p = None if top_p is None else top_p.clone()
    min_p = None if min_p is None else min_p.clone()
    for n in range(x.shape[0]):
        t = float(temperature[n])
        if t <= 0:
            continue
        row = x[n][x[n] > -INF].sort(descending=True).values
        ratio = ((row - row[0]) / t).exp()
        if min_p is not None and 0 < min_p[n] < 1:
            min_p[n] = _away(float(min_p[n]), ratio, 1e-6, 1 - 2 * MARGIN)
        if top_p is not None and top_p[n] < 1:
            in_s = torch.ones_like(ratio, dtype=torch.bool)
            if top_k is not None:
                in_s[int(top_k[n]) :] = False
            if min_p is not None:
                in_s &= ratio >= float(min_p[n])
            mass = ratio[in_s]
            cumulative = mass.cumsum(0) / mass.sum()
            top_p[n] = _away(float(top_p[n]), cumulative[:-1], 1e-6, 1 - 2 * MARGIN)
    return top_p, min_p


def random_filters(num_rows: int, vocab_size: int, gen: torch.Generator, *, off: float = 0.3):
    """Per-row (temperature, top_k, top_p, min_p), each filter off on about `off` of the rows
    and every mix of them in one batch; a few greedy rows."""
    temperature = torch.rand(num_rows, generator=gen) * 1.8 + 0.2
    temperature[torch.rand(num_rows, generator=gen) < 0.1] = 0.0
    top_k = torch.randint(1, vocab_size + 1, (num_rows,), generator=gen)
    small = torch.rand(num_rows, generator=gen) < 0.5  # small k is the common setting
    top_k[small] = torch.randint(1, 50, (int(small.sum()),), generator=gen)
    top_p = torch.rand(num_rows, generator=gen) * 0.99 + 0.01
    min_p = torch.rand(num_rows, generator=gen) ** 2 * 0.5

    def off_rows() -> torch.Tensor:
        return torch.rand(num_rows, generator=gen) < off

    top_k[off_rows()] = vocab_size
    top_p[off_rows()] = 1.0
    min_p[off_rows()] = 0.0
    return temperature, top_k, top_p, min_p


def tie_free(num_rows: int, vocab_size: int, gen: torch.Generator, scale: float = 3.0):
    """float32 logits, Gaussian-like, with distinct values in every row (float32 Gaussians
    repeat a value in about 1 row of 50 at V = 1000)."""
    values = (torch.randn(num_rows, vocab_size, generator=gen) * scale).sort(dim=1).values
    values += torch.arange(vocab_size) * 1e-4  # strictly increasing, even after rounding
    order = torch.rand(num_rows, vocab_size, generator=gen).argsort(dim=1)
    logits = values.gather(1, order)
    assert all(row.unique().numel() == vocab_size for row in logits)
    return logits


def assert_matches_reference(thresholds_fn, logits, temperature, top_k, top_p, min_p):
    top_p, min_p = safe_filters(logits, temperature, top_k, top_p, min_p)
    thresholds = thresholds_fn(logits, temperature, top_k, top_p, min_p)
    assert thresholds.dtype == torch.float32 and thresholds.shape == logits.shape[:1]
    expect = reference_kept(logits, temperature, top_k, top_p, min_p)
    got = kept(logits, thresholds)
    bad = (got != expect).any(1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad}: kept {got[bad].sum(1).tolist()} vs {expect[bad].sum(1).tolist()}"
    return thresholds


# --- torch path against the sort oracle --------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [32, 300, 1000])
@pytest.mark.parametrize("which", ["k", "p", "min_p", "k+p", "k+min_p", "p+min_p", "all"])
def test_torch_path_matches_sort_on_tie_free_rows(vocab_size, which):
    gen = torch.Generator().manual_seed(vocab_size + len(which))
    logits = tie_free(96, vocab_size, gen)
    t, k, p, m = random_filters(96, vocab_size, gen)
    k, p, m = (v if name in which.split("+") or which == "all" else None
               for name, v in (("k", k), ("p", p), ("min_p", m)))  # fmt: skip
    assert_matches_reference(filter_thresholds_torch, logits, t, k, p, m)


def test_unfiltered_and_greedy_rows_get_minus_inf():
    logits = tie_free(6, 50, torch.Generator().manual_seed(0))
    t = torch.tensor([1.0, 0.7, 0.0, 1.0, -1.0, 2.0])
    k = torch.tensor([50, 50, 3, 50, 3, 50], dtype=torch.int32)
    p = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.5, 1.0])
    m = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.5, 0.0])
    expect = torch.full((6,), -INF)
    torch.testing.assert_close(filter_thresholds(logits, t, k, p, m), expect, rtol=0, atol=0)
    torch.testing.assert_close(filter_thresholds(logits, t), expect, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_extreme_settings(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = tie_free(4, 200, gen).to(dtype)
    x = logits.float()
    t = torch.full((4,), 0.9)

    def thresholds(k=None, p=None, m=None) -> torch.Tensor:
        def per_row(v, dtype):
            return None if v is None else torch.full((4,), v, dtype=dtype)

        return filter_thresholds(logits, t, per_row(k, torch.int64), per_row(p, torch.float32),
                                 per_row(m, torch.float32))  # fmt: skip

    row_max = x.amax(1)
    for only_max in (thresholds(k=1), thresholds(p=1e-6), thresholds(m=1.0),
                     thresholds(k=7, p=1e-6, m=0.0)):  # fmt: skip
        torch.testing.assert_close(only_max, row_max, rtol=0, atol=0)
    for off in (thresholds(k=200), thresholds(p=1.0), thresholds(m=0.0), thresholds(200, 1.0, 0.0)):
        assert (off == -INF).all()
    k5 = thresholds(k=5)
    assert (kept(logits, k5).sum(1) == 5).all()
    torch.testing.assert_close(k5, x.topk(5, dim=1).values[:, -1], rtol=0, atol=0)


def test_keys_order_like_the_floats():
    values = torch.tensor([-INF, -3e38, -2.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 2.0, 3e38, INF])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        v = values.to(dtype)
        keys = sortable_keys(v)
        assert keys.dtype == torch.int32
        assert (keys[1:] >= keys[:-1]).all() and keys[5] == keys[6]  # -0.0 == 0.0
        assert ((keys[1:] > keys[:-1]) == (v[1:].float() > v[:-1].float())).all()
        assert (key_values(keys, dtype) == v.float()).all()


def test_strided_rows_match_contiguous():
    gen = torch.Generator().manual_seed(2)
    wide = tie_free(12, 2 * 400, gen).view(12, 2, 400)
    logits = wide[:, 1, 13:313]  # row stride 800, 300 columns
    t, k, p, m = random_filters(12, 300, gen, off=0.0)
    t = t.clamp_min(0.2)
    p, m = safe_filters(logits, t, k, p, m)
    torch.testing.assert_close(filter_thresholds(logits, t, k, p, m),
                               filter_thresholds(logits.contiguous(), t, k, p, m), rtol=0, atol=0)
    assert_matches_reference(filter_thresholds_torch, logits, t, k, p, m)
    columns = tie_free(300, 12, gen).t()  # column-major: stride_v = 12
    assert_matches_reference(filter_thresholds_torch, columns, t, k, p, m)


def widen_to_ties(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """top_k grown to cover every tie of each row's k-th largest value: with a tie cut by
    top-k, the sort's S and the thresholds' S differ, and so does top-p's renormalisation."""
    x = logits.float()
    kth = x.sort(dim=1, descending=True).values.gather(1, (top_k.long() - 1)[:, None])
    return (x >= kth).sum(1)


def assert_sort_set_plus_ties(logits, temperature, top_k, top_p, min_p, thresholds):
    """The kept set is the sort's plus the ties of its smallest kept value."""
    x = logits.float()
    expect = reference_kept(logits, temperature, top_k, top_p, min_p)
    got = kept(logits, thresholds)
    assert (got >= expect).all(), "a token the sort keeps is dropped"
    smallest = torch.where(expect, x, INF).amin(1)
    filtered = (thresholds > -INF)[:, None]
    ties = (x == smallest[:, None]) & filtered
    torch.testing.assert_close(got, expect | ties, rtol=0, atol=0)
    if min_p is None:  # then every threshold is a logit: the smallest kept one
        assert ((thresholds == smallest) | ~filtered[:, 0]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ties_are_kept_whole(dtype):
    """Half-precision rows with many equal logits: the kept set is the sort's plus the ties of
    its smallest kept value (top_k widened to its k-th value's ties, see `widen_to_ties`)."""
    gen = torch.Generator().manual_seed(3)
    num_rows, vocab_size = 64, 400
    logits = (torch.randn(num_rows, vocab_size, generator=gen) * 2).round(decimals=1).to(dtype)
    x = logits.float()
    t, k, p, m = random_filters(num_rows, vocab_size, gen, off=0.3)
    t = t.clamp_min(0.3)
    k = widen_to_ties(logits, k)
    p, m = safe_filters(logits, t, k, p, m)
    for ks, ps, ms in ((k, None, None), (None, p, None), (None, p, m), (k, None, m), (k, p, m)):
        thresholds = filter_thresholds_torch(logits, t, ks, ps, ms)
        assert_sort_set_plus_ties(logits, t, ks, ps, ms, thresholds)
    # Top-k alone keeps every tie of the k-th value: more than k when it is tied.
    k3 = torch.full((num_rows,), 3)
    counts = kept(logits, filter_thresholds_torch(logits, t, k3, None, None)).sum(1)
    third = x.sort(dim=1, descending=True).values[:, 2:3]
    torch.testing.assert_close(counts, (x >= third).sum(1), rtol=0, atol=0)
    assert (counts > 3).any()


def test_minus_inf_logits_are_never_kept_and_cannot_fill_top_k():
    gen = torch.Generator().manual_seed(4)
    logits = tie_free(8, 64, gen)
    logits[:, ::2] = -INF  # 32 finite tokens per row
    logits[3, 2:] = -INF  # one finite token, column 1
    t = torch.ones(8)
    k = torch.tensor([1, 5, 31, 40, 64, 32, 33, 2])
    p = torch.tensor([0.5, 0.9, 1.0, 0.3, 0.99, 1.0, 0.8, 1.0])
    assert_matches_reference(filter_thresholds_torch, logits, t, k, p, None)
    # k beyond the finite tokens keeps them all.
    assert kept(logits, filter_thresholds_torch(logits, t, k, None, None))[3].sum() == 1
    assert (kept(logits, filter_thresholds_torch(logits, t, k, None, None))[[5, 6]].sum(1)
            == 32).all()  # fmt: skip


def test_torch_path_is_sort_free_and_bounded_in_memory():
    """At Qwen3's vocabulary the torch path's temporaries stay within `_FILTER_BYTES` (plus the
    output), under 1/8 of 256 rows of bf16 logits, and no op sorts or ranks the vocabulary."""
    gen = torch.Generator().manual_seed(5)
    num_rows = 6
    logits = torch.randn(num_rows, QWEN3_VOCAB, generator=gen).mul_(3).bfloat16()
    t = torch.full((num_rows,), 0.8)
    k = torch.tensor([50, 1, QWEN3_VOCAB, 20, 1000, 5])
    p = torch.tensor([0.9, 1.0, 0.95, 0.5, 1.0, 0.7])
    m = torch.tensor([0.05, 0.0, 0.0, 0.1, 0.01, 0.0])
    with watch_memory("cpu") as watch:
        thresholds = filter_thresholds_torch(logits, t, k, p, m)
    assert watch.peak_bytes <= _FILTER_BYTES + 4096
    assert watch.peak_bytes <= 256 * QWEN3_VOCAB * 2 / 8
    ranking = {"sort", "argsort", "topk", "kthvalue", "msort", "cumsum", "median", "mode"}
    assert not {op.split(".")[0] for op in watch.ops} & ranking, sorted(watch.ops)
    with watch_memory("cpu") as watch:
        sort_filter_reference(logits, t, k, p, m)
    assert watch.peak_bytes > 4 * logits.nbytes  # the tracker sees the sort's copies
    # 151,936 bf16 values cannot all differ: check the sort's set plus ties.
    k = widen_to_ties(logits, k)
    p, m = safe_filters(logits, t, k, p, m)
    thresholds = filter_thresholds_torch(logits, t, k, p, m)
    assert_sort_set_plus_ties(logits, t, k, p, m, thresholds)
    assert (thresholds > -INF).all()


@pytest.mark.parametrize(
    "change,setting",
    [
        (dict(logits=torch.zeros(4)), "logits"),
        (dict(logits=torch.zeros(2, 5, dtype=torch.float64)), "logits dtype"),
        (dict(temperature=torch.ones(3)), "temperature"),
        (dict(top_k=torch.ones(2)), "top_k"),
        (dict(top_p=torch.ones(2, dtype=torch.float64)), "top_p"),
        (dict(min_p=torch.ones(3)), "min_p"),
    ],
)
def test_bad_input_names_the_setting(change, setting):
    args = dict(logits=torch.zeros(2, 5), temperature=torch.ones(2))
    with pytest.raises(ValueError, match=setting):
        filter_thresholds(**{**args, **change})
    with pytest.raises(ValueError, match="thresholds"):
        gumbel_sample(torch.zeros(2, 5), torch.ones(2), torch.arange(2), torch.zeros(3))


# --- sampling under thresholds -----------------------------------------------------------------


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= observed) for counts against probs (all > 0), df = len - 1."""
    expected = probs.double() * counts.sum()
    chi2 = ((counts.double() - expected) ** 2 / expected).sum()
    df = torch.tensor(counts.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, chi2 / 2))


SETTINGS = [  # (temperature, top_k, top_p, min_p) over a 32-token vocabulary
    (1.0, 12, 1.0, 0.0),
    (0.7, 32, 0.8, 0.0),
    (1.3, 32, 1.0, 0.05),
    (0.9, 20, 0.9, 0.02),
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_thresholds_and_gumbel_sample_the_sort_filtered_softmax(setting):
    """20,000 draws (one row per seed, all with the same logits) against the softmax of the
    sort-filtered tempered logits: a chi-square test, and no draw outside the sort's set."""
    temperature, k, p, m = setting
    num_draws, vocab_size = 20_000, 32
    row = tie_free(1, vocab_size, torch.Generator().manual_seed(6), scale=1.5)
    logits = row.expand(num_draws, -1)
    t = torch.full((num_draws,), temperature)
    settings = ((k, torch.int64), (p, torch.float32), (m, torch.float32))
    k_, p_, m_ = (torch.full((num_draws,), v, dtype=d) for v, d in settings)
    tokens = gumbel_sample(logits, t, torch.arange(num_draws) * 7919 - 5,
                           filter_thresholds(logits, t, k_, p_, m_))  # fmt: skip
    probs = sort_filter_reference(row, t[:1], k_[:1], p_[:1], m_[:1])[0].softmax(-1)
    counts = torch.bincount(tokens, minlength=vocab_size)
    assert counts[probs == 0].sum() == 0
    assert chi_square_p_value(counts[probs > 0], probs[probs > 0]) > 1e-3


def _triton_gumbel(logits, temperature, seeds, thresholds=None):
    return triton_sampling.gumbel_sample_triton(logits, temperature, seeds, thresholds, block=16)


GUMBEL = [
    pytest.param(gumbel_sample_torch, id="torch"),
    pytest.param(_triton_gumbel, id="triton", marks=[_interpreted]),
]


@pytest.mark.parametrize("sample", GUMBEL)
def test_gumbel_draws_only_kept_columns_and_minus_inf_changes_nothing(sample):
    gen = torch.Generator().manual_seed(7)
    num_rows, vocab_size = 48, 61
    logits = tie_free(num_rows, vocab_size, gen, scale=0.3)  # near-flat: noise decides
    t, k, p, m = random_filters(num_rows, vocab_size, gen)
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=gen)
    thresholds = filter_thresholds_torch(logits, t, k, p, m)
    tokens = sample(logits, t, seeds, thresholds)
    keep = kept(logits, thresholds)
    greedy = t <= 0
    assert keep.gather(1, tokens[:, None])[~greedy].all()
    # Greedy rows ignore thresholds, even ones that would drop the argmax.
    high = torch.where(greedy, INF, thresholds)
    torch.testing.assert_close(sample(logits, t, seeds, high)[greedy], logits[greedy].argmax(1),
                               rtol=0, atol=0)  # fmt: skip
    unfiltered = sample(logits, t, seeds)
    torch.testing.assert_close(sample(logits, t, seeds, torch.full((num_rows,), -INF)),
                               unfiltered, rtol=0, atol=0)  # fmt: skip
    # The draws outside the kept set changed to kept tokens; some rows had to change.
    assert (unfiltered != tokens)[~greedy].any()


@pytest.mark.parametrize("thresholds_fn", [
    pytest.param(filter_thresholds_torch, id="torch"),
    pytest.param(lambda *a: triton_filters.filter_thresholds_triton(*a, chunk=16), id="triton",
                 marks=[_interpreted, pytest.mark.filterwarnings("ignore::RuntimeWarning")]),
])  # fmt: skip
def test_vanishing_temperature_keeps_the_top_logit(thresholds_fn):
    """At a temperature whose 1 / T overflows float32 the tempered mass is all on the top
    logit: top-p keeps it alone (an inf scale made its weight 0 x inf = NaN, and the search
    then kept every column)."""
    logits = torch.tensor([[-3.0, 0.5, -1.0, 2.5, 1.0] * 8] * 2)
    temperature = torch.tensor([1e-40, 1e-45])
    got = thresholds_fn(logits, temperature, None, torch.full((2,), 0.5), None)
    assert got.tolist() == [2.5, 2.5]


# --- Triton kernel through the interpreter -----------------------------------------------------


def _triton_thresholds(logits, temperature, top_k, top_p, min_p, **knobs):
    # Pieces much smaller than the vocabulary, so every row is split over several programs.
    # float64 masses unless a test asks otherwise: the kept sets are compared bit for bit.
    return triton_filters.filter_thresholds_triton(
        logits, temperature, top_k, top_p, min_p, **{"chunk": 64, "mass_float64": True, **knobs}
    )


@interpret
def test_kernel_float32_piece_masses_keep_the_same_set_clear_of_rounding():
    """The default sums a piece's masses in float32: with top_p clear of every boundary by
    more than float32 rounding, the kept set is the exact one."""
    gen = torch.Generator().manual_seed(21)
    logits = tie_free(16, 1000, gen)
    t, k, p, m = random_filters(16, 1000, gen, off=0.25)
    p, m = safe_filters(logits, t, k, p, m)
    exact = _triton_thresholds(logits, t, k, p, m)
    got = _triton_thresholds(logits, t, k, p, m, mass_float64=False)
    torch.testing.assert_close(kept(logits, got), kept(logits, exact), rtol=0, atol=0)


@interpret
@pytest.mark.parametrize("vocab_size", [300, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_torch_path(vocab_size, dtype):
    gen = torch.Generator().manual_seed(vocab_size)
    num_rows = 16
    logits = tie_free(num_rows, vocab_size, gen).to(dtype)
    t, k, p, m = random_filters(num_rows, vocab_size, gen, off=0.25)
    k = k.int()  # int32 top_k, as the contract allows
    p, m = safe_filters(logits, t, k, p, m)
    got = _triton_thresholds(logits, t, k, p, m)
    expect = filter_thresholds_torch(logits, t, k, p, m)
    torch.testing.assert_close(kept(logits, got), kept(logits, expect), rtol=0, atol=0)
    # Thresholds not set by min-p (whose log may round differently) are logits: equal.
    exact = (expect == -INF) | (logits.float() == expect[:, None]).any(1)
    torch.testing.assert_close(got[exact], expect[exact], rtol=0, atol=0)
    if dtype == torch.float32:
        assert_matches_reference(_triton_thresholds, logits, t, k, p, m)


@interpret
def test_kernel_knobs_none_filters_and_strides():
    gen = torch.Generator().manual_seed(8)
    wide = tie_free(10, 700, gen).view(10, 2, 350)
    logits = wide[:, 1, 20:320]  # row stride 700, 300 columns
    t, k, p, m = random_filters(10, 300, gen, off=0.2)
    p, m = safe_filters(logits, t, k, p, m)
    expect = filter_thresholds_torch(logits, t, k, p, m)
    for knobs in (dict(), dict(chunk=32, candidates=2), dict(chunk=128, candidates=4)):
        got = _triton_thresholds(logits, t, k, p, m, **knobs)
        torch.testing.assert_close(kept(logits, got), kept(logits, expect), msg=str(knobs))
    for filters in ((k, None, None), (None, p, None), (None, None, m), (None, None, None)):
        torch.testing.assert_close(kept(logits, _triton_thresholds(logits, t, *filters)),
                                   kept(logits, filter_thresholds_torch(logits, t, *filters)))


@interpret
def test_kernel_ties_and_minus_inf():
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(12, 300, generator=gen) * 2).round(decimals=1).half()
    logits[2, ::3] = -INF
    logits[5, 1:] = -INF
    t, k, p, m = random_filters(12, 300, gen, off=0.2)
    got = _triton_thresholds(logits, t, k, None, m)  # counts only: no mass rounding at all
    torch.testing.assert_close(got, filter_thresholds_torch(logits, t, k, None, m))
    got = _triton_thresholds(logits, t, k, p, m)
    torch.testing.assert_close(kept(logits, got),
                               kept(logits, filter_thresholds_torch(logits, t, k, p, m)))


# --- GPU ---------------------------------------------------------------------------------------


def _gpu_batch(num_rows: int, dtype: torch.dtype = torch.bfloat16, seed: int = 10):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, QWEN3_VOCAB, generator=gen) * 3).to(dtype).cuda()
    t, k, p, m = (v.cuda() for v in random_filters(num_rows, QWEN3_VOCAB, gen, off=0.25))
    return logits, t, k, p, m


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kernel_matches_torch_path(dtype):
    num_rows = 256 if dtype == torch.bfloat16 else 32
    logits, t, k, p, m = _gpu_batch(num_rows, dtype)
    got = triton_filters.filter_thresholds_triton(logits, t, k, p, m, mass_float64=True)
    expect = filter_thresholds_torch(logits, t, k, p, m)
    # Masses summed in float64 on both paths: no summation order moves a threshold.
    mismatched = (kept(logits, got) != kept(logits, expect)).any(1).nonzero().flatten()
    assert mismatched.numel() == 0, mismatched.tolist()
    # The default's float32 piece sums move a threshold only where a row's mass lies within
    # float32 rounding of top_p: rare at 256 random bf16 rows, never systematic.
    default = filter_thresholds(logits, t, k, p, m)
    moved = (kept(logits, default) != kept(logits, expect)).any(1).sum().item()
    assert moved <= max(1, num_rows // 100), moved
    # Top-k alone is a count: the thresholds themselves are equal.
    torch.testing.assert_close(filter_thresholds(logits, t, k),
                               filter_thresholds_torch(logits, t, k), rtol=0, atol=0)  # fmt: skip


@pytest.mark.gpu
def test_gpu_kernel_matches_sort_on_tie_free_rows():
    gen = torch.Generator().manual_seed(11)
    logits = tie_free(64, QWEN3_VOCAB, gen)
    t, k, p, m = random_filters(64, QWEN3_VOCAB, gen, off=0.25)
    p, m = safe_filters(logits, t, k, p, m)
    cuda = [v.cuda() for v in (logits, t, k, p, m)]
    thresholds = filter_thresholds(*cuda).cpu()
    expect = reference_kept(logits, t, k, p, m)
    torch.testing.assert_close(kept(logits, thresholds), expect)


@pytest.mark.gpu
def test_gpu_filter_and_sample_memory_and_no_recompiles():
    """filter_thresholds + gumbel_sample at 256 x 151,936 bf16 allocate at most 1/8 of the
    logits, draw only kept tokens, and compile nothing new for other batch sizes or filter
    mixes once warmed up."""
    from kvfit.ops.compiles import triton_compiles

    logits, t, k, p, m = _gpu_batch(256)
    seeds = torch.arange(256, device="cuda")
    thresholds = filter_thresholds(logits, t, k, p, m)
    gumbel_sample(logits, t, seeds, thresholds)  # warm
    gumbel_sample(logits, t, seeds)
    with watch_memory("cuda") as watch:
        thresholds = filter_thresholds(logits, t, k, p, m)
        tokens = gumbel_sample(logits, t, seeds, thresholds)
    assert watch.peak_bytes <= logits.nbytes / 8, watch.peak_bytes / logits.nbytes
    sampled = t > 0
    assert kept(logits, thresholds).gather(1, tokens[:, None])[sampled].all()
    with triton_compiles() as compiled:
        for n in (1, 3, 64, 200, 256):
            rows = slice(0, n)
            for filters in ((k, p, m), (k, None, None), (None, p, None), (None, None, m)):
                part = [None if f is None else f[rows] for f in filters]
                thr = filter_thresholds(logits[rows], t[rows], *part)
                gumbel_sample(logits[rows], t[rows], seeds[rows], thr)
            gumbel_sample(logits[rows], t[rows], seeds[rows])
    torch.cuda.synchronize()
    assert not compiled, compiled


@pytest.mark.gpu
def test_gpu_minus_inf_thresholds_are_bit_exact():
    logits, t, _, _, _ = _gpu_batch(64)
    seeds = torch.randint(-(2**62), 2**62, (64,), device="cuda")
    none = gumbel_sample(logits, t, seeds)
    minus_inf = gumbel_sample(logits, t, seeds, torch.full((64,), -INF, device="cuda"))
    torch.testing.assert_close(minus_inf, none, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_distribution_at_full_vocab():
    """One bf16 row drawn 20,000 times under top-k 50 / top-p 0.9: the kept set is the sort's
    plus the ties of its smallest value (151,936 bf16 values hold ties, which the thresholds
    keep whole by design), and the draws' frequencies follow the softmax over that set."""
    num_draws = 20_000
    row = (torch.randn(1, QWEN3_VOCAB, generator=torch.Generator().manual_seed(12)) * 2.5)
    row = row.bfloat16().cuda()
    t1 = torch.full((1,), 0.8, device="cuda")
    k1 = widen_to_ties(row, torch.full((1,), 50, device="cuda"))
    p1, _ = safe_filters(row, t1, k1, torch.full((1,), 0.9, device="cuda"), None)
    logits = row.expand(num_draws, -1)
    t, k, p = (v.expand(num_draws).contiguous() for v in (t1, k1, p1))
    thresholds = filter_thresholds(logits, t, k, p)
    assert_sort_set_plus_ties(row, t1, k1, p1, None, thresholds[:1])
    tokens = gumbel_sample(logits, t, torch.arange(num_draws, device="cuda"), thresholds)
    # The law of the kept set (the sort's plus the ties of its smallest value, checked above):
    # the H200 drew 373 of 20,000 from such ties where a top-p boundary fell inside a tie.
    keep = kept(row, thresholds[:1])
    probs = (row.float() / t1[:, None]).masked_fill(~keep, -INF)[0].softmax(-1).cpu()
    counts = torch.bincount(tokens.cpu(), minlength=QWEN3_VOCAB)
    assert counts[probs == 0].sum() == 0
    assert chi_square_p_value(counts[probs > 0], probs[probs > 0]) > 1e-3


def test_chi_square_p_value_rejects_a_wrong_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    assert chi_square_p_value(torch.tensor([5000, 3000, 2000]), probs) > 0.99
    assert chi_square_p_value(torch.tensor([5200, 2900, 1900]), probs) < 1e-3
    assert math.isfinite(chi_square_p_value(torch.tensor([1, 1, 1]), probs))
