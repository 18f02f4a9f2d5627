"""kvfit.benchmarks.profiling: kernel names grouped into families, a profile built from the
profiler's events (fake ones with the fields torch gives, so device kernels exist on a CPU
machine), two profiles side by side, and the step annotation on a real engine."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.profiling import (
    FAMILY_NAMES,
    STEP_PREFIX,
    comparison_text,
    kernel_family,
    kernel_profile,
    profile_run,
    profile_text,
)

from .scripts import load_bench

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def test_kernel_names_fall_in_their_families() -> None:
    # Names as torch.profiler reported them on the H200 (docs/results/profile-offline-*.txt).
    families = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm.cublas",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "gemm.cublas",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm.cublas",
        "_matmul_kernel": "gemm.triton",
        "_prefill_kernel": "attention.prefill",
        "_decode_kernel": "attention.decode", "_reduce_splits_kernel": "attention.decode",
        "_decode_input_kernel": "attention.decode",
        "_attention_input_kernel": "attention.input", "_write_kv_kernel": "attention.input",
        "_rms_norm_kernel": "norm",
        "_silu_and_mul_kernel": "activation",
        "_gumbel_argmax_kernel": "sampling", "_logsumexp_kernel": "sampling",
        "_radix_kernel": "sampling",
        "Memcpy HtoD (Pinned -> Device)": "memcpy", "Memset (Device)": "memcpy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>":
            "other",
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16>": "other",
    }
    assert {name: kernel_family(name) for name in families} == families
    assert set(families.values()) == set(FAMILY_NAMES)


def test_every_kernel_kvfit_launches_has_a_family() -> None:
    """Each Triton kernel in the source lands in a family: one left in "other" hid the e4m3
    decode (`_decode_fp8_pairs_kernel`, 63% of an fp8 run) and the small-batch linear layers
    from the family split."""
    src = Path(__file__).parents[2] / "src" / "kvfit"
    kernels = {node.name for path in src.rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
               and any("jit" in ast.unparse(d) for d in node.decorator_list)}
    assert {"_decode_kernel", "_decode_fp8_pairs_kernel", "_skinny_kernel"} <= kernels
    assert {k: kernel_family(k) for k in kernels if kernel_family(k) == "other"} == {}


def _kernel(name: str, start: float, end: float, device: int = 0, stream: int = 7) -> NS:
    return NS(name=name, device_type=CUDA, device_index=device, device_resource_id=stream,
              time_range=NS(start=start, end=end), is_user_annotation=False, cpu_children=[],
              kernels=[])


def _cpu(name: str, start: float, end: float, children: tuple = (),
         kernels: tuple = ()) -> NS:
    """A CPU event with the kernels torch links to it (by correlation id)."""
    linked = [NS(name=k.name, duration=k.time_range.end - k.time_range.start) for k in kernels]
    return NS(name=name, device_type=CPU, device_index=-1, device_resource_id=0,
              time_range=NS(start=start, end=end),
              is_user_annotation=name.startswith(STEP_PREFIX), cpu_children=list(children),
              kernels=linked)


def _span(kind: str, start: float, end: float, flag: bool = True, stream: int = 7) -> NS:
    """A step range's device-side span on one stream (the step's first to last kernel there);
    torch flags it as a user annotation, should a version not, its name tells it from a
    kernel."""
    return NS(name=STEP_PREFIX + kind, device_type=CUDA, device_index=0,
              device_resource_id=stream, is_user_annotation=flag,
              time_range=NS(start=start, end=end), cpu_children=[], kernels=[])


def fake_events(decode_us: float, flag_span: bool = True, spans: bool = True,
                linked: bool = True) -> list[NS]:
    """A mixed step (a cuBLAS GEMM under aten::mm, a Triton prefill launched from the step
    itself) and a decode step (Triton GEMM and decode attention, `decode_us` long), each with
    its range's device-side span if `spans`, and a copy starting as the decode span ends: in no
    span, linked to no step. `linked`: torch linked each step's kernels to its range (it does
    not for CUDA graph replays)."""
    gemm = _kernel("nvjet_sm90_tst_64x32", 2_000, 2_600)
    prefill = _kernel("_prefill_kernel", 2_600, 4_000)
    matmul = _kernel("_matmul_kernel", 4_000, 4_500)
    decode = _kernel("_decode_kernel", 4_500, 4_500 + decode_us)
    copy = _kernel("Memcpy DtoH (Device -> Pinned)", 4_500 + decode_us, 4_600 + decode_us)

    def links(*kernels: NS) -> tuple:
        return kernels if linked else ()

    mm = _cpu("aten::mm", 100, 200, kernels=links(gemm))
    mixed = _cpu(STEP_PREFIX + "mixed", 0, 1_000, children=(mm,), kernels=links(prefill))
    step = _cpu(STEP_PREFIX + "decode", 1_000, 1_500, kernels=links(matmul, decode))
    device_spans = [_span("mixed", 2_000, 4_000, flag_span),
                    _span("decode", 4_000, 4_500 + decode_us, flag_span)] if spans else []
    return [mixed, mm, step, gemm, prefill, matmul, decode, copy, *device_spans]


def _nonzero(families: dict[str, float]) -> dict[str, float]:
    return {f: us for f, us in families.items() if us}


@pytest.mark.parametrize("flag_span", [True, False])
@pytest.mark.parametrize("linked", [True, False])
def test_a_profile_from_events(flag_span: bool, linked: bool) -> None:
    p = kernel_profile(fake_events(1_500, flag_span, linked=linked), bins=4)
    assert {k: (s.device_us, s.count) for k, s in p.kernels.items()} == {
        "nvjet_sm90_tst_64x32": (600, 1), "_prefill_kernel": (1_400, 1),
        "_matmul_kernel": (500, 1), "_decode_kernel": (1_500, 1),
        "Memcpy DtoH (Device -> Pinned)": (100, 1)}  # the ranges' device spans are no kernels
    assert p.wall_s == pytest.approx(6_100 / 1e6)
    # Kernels run from 2000 to 6100 of [0, 6100]: quarters of 1525 us.
    assert p.busy == pytest.approx([0.0, 1 - 475 / 1525, 1.0, 1.0])
    families = p.families_us()
    assert families["gemm.cublas"] == 600 and families["gemm.triton"] == 500
    assert families["attention.decode"] == 1_500 and families["memcpy"] == 100
    assert p.step_counts == {"mixed": 1, "decode": 1}
    assert p.step_host_us == {"mixed": 1_000, "decode": 500}
    assert p.step_device_span_us == {"mixed": 2_000, "decode": 2_000}
    # By the spans, links or none: the copy starts where the decode span ends, in no step.
    assert p.attribution == "span"
    assert _nonzero(p.step_families_us["mixed"]) == {"gemm.cublas": 600,
                                                     "attention.prefill": 1_400}
    assert _nonzero(p.step_families_us["decode"]) == {"gemm.triton": 500,
                                                      "attention.decode": 1_500}
    record = p.as_dict(top=2)
    assert record["attributed_to_steps"] == pytest.approx(4_000 / 4_100)
    assert record["attribution"] == "span"
    assert record["families_ms"]["attention.prefill"] == 1.4
    assert [k["name"] for k in record["top_kernels"]] == ["_decode_kernel", "_prefill_kernel"]
    assert record["steps"]["decode"] == {"count": 1, "host_ms": 0.5, "device_span_ms": 2.0,
                                         "families_ms": {f: us / 1e3 for f, us in
                                                         p.step_families_us["decode"].items()}}


def test_without_device_spans_kernels_follow_their_links() -> None:
    p = kernel_profile(fake_events(1_500, spans=False))
    assert p.attribution == "link" and p.step_device_span_us == {}
    # aten::mm's kernel counts for the mixed step whose range holds aten::mm.
    assert _nonzero(p.step_families_us["mixed"]) == {"gemm.cublas": 600,
                                                     "attention.prefill": 1_400}
    assert _nonzero(p.step_families_us["decode"]) == {"gemm.triton": 500,
                                                      "attention.decode": 1_500}
    assert p.as_dict()["attributed_to_steps"] == pytest.approx(4_000 / 4_100)
    unlinked = kernel_profile(fake_events(1_500, spans=False, linked=False))
    assert unlinked.attribution == "link" and unlinked.as_dict()["attributed_to_steps"] == 0.0
    assert unlinked.step_counts == {"mixed": 1, "decode": 1}


def test_overlapping_spans_give_a_kernel_to_the_latest_starting() -> None:
    # Spans on one stream: mixed A [0, 1000) overlapped by decode B [900, 1500), decode C
    # [1500, 1600) touching B, and mixed D [2000, 5000) around decode E [2100, 2200).
    spans = [_span("mixed", 0, 1_000), _span("decode", 900, 1_500), _span("decode", 1_500, 1_600),
             _span("mixed", 2_000, 5_000), _span("decode", 2_100, 2_200)]
    # One kernel name, durations in powers of two: each total says which kernels it holds.
    starts = {1: 850, 2: 950, 4: 1_500, 8: 1_700, 16: 2_150, 32: 2_300}
    kernels = [_kernel("_matmul_kernel", t, t + us) for us, t in starts.items()]
    # No span on device 1 or on stream 8 of device 0.
    kernels += [_kernel("_matmul_kernel", 950, 1_014, device=1),
                _kernel("_matmul_kernel", 950, 1_078, stream=8)]
    p = kernel_profile([*spans, *kernels])
    assert p.attribution == "span" and p.device_us == 255
    # A alone holds 850; 950 is in A and B, B started later; 1500 is past B's end, in C; 1700
    # is between steps; 2150 in D and E, E started later; 2300 in D (E has ended).
    assert _nonzero(p.step_families_us["mixed"]) == {"gemm.triton": 1 + 32}
    assert _nonzero(p.step_families_us["decode"]) == {"gemm.triton": 2 + 4 + 16}
    assert p.as_dict()["attributed_to_steps"] == pytest.approx(55 / 255)
    assert p.step_device_span_us == {"mixed": 4_000, "decode": 800}


def _row(text: str, label: str) -> list[str]:
    return next(ln for ln in text.splitlines() if ln.split()[:1] == [label]).split()


def test_two_profiles_side_by_side() -> None:
    base, slow = kernel_profile(fake_events(1_500)), kernel_profile(fake_events(5_500))
    text = comparison_text({"default": base, "deterministic": slow})
    # family, default ms, share, deterministic ms, share, diff ms, diff % of default's total
    assert _row(text, "attention.decode") == ["attention.decode", "1.5", "36.6%", "5.5",
                                              "67.9%", "4.0", "97.6%"]
    assert _row(text, "total")[1::2][:3] == ["4.1", "8.1", "4.0"]
    assert "decode steps (default / deterministic): 1 / 1, host ms 0.5 / 0.5, device span " \
           "ms 2.0 / 6.0" in text
    kernel_rows = [ln for ln in text.splitlines() if ln.startswith("_decode_kernel")]
    assert kernel_rows[0].split() == ["_decode_kernel", "attention.decode", "1.5", "1", "5.5",
                                      "1", "4.0"]
    assert "device time attributed: default 98% by span, deterministic 99% by span" in text
    one = profile_text(base)
    assert one.startswith("offline workload under the profiler: 0.01 s, device busy 67%")
    assert _row(one, "attention.prefill")[1:] == ["1.4", "34.1%"]


@pytest.fixture(scope="module")
def throughput():  # noqa: ANN201 (bench/throughput.py)
    return load_bench("throughput")


def test_every_engine_step_is_annotated_with_its_kind(throughput) -> None:  # noqa: ANN001
    llm = LLM("kvfit-tiny", device="cpu", max_model_len=128, max_num_batched_tokens=32)
    prompts = [{"prompt_token_ids": [i] + [7] * (n - 1)} for i, n in ((1, 5), (2, 40), (3, 17))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 1, 6)]
    with throughput.StepRecorder(llm) as recorder:  # the annotation nests inside it
        profile = profile_run(lambda: llm.generate(prompts, params, use_tqdm=False), llm,
                              llm.config.device)
    decodes = sum(all(n == 1 for n in s.num_new) for s in recorder.steps)
    assert profile.step_counts == {"mixed": len(recorder.steps) - decodes, "decode": decodes}
    assert decodes > 0 and profile.step_host_us["mixed"] > 0
    assert profile.attribution == "span" and profile.device_us == 0  # no kernel on a CPU
    assert "launch" not in vars(llm.engine.executor)  # both wrappers gone
    assert STEP_PREFIX + "mixed" in profile.table
    llm.shutdown()
