"""Tiny synthetic payloads, shaped as each bench writes them, for the record/plot/compare tests."""

from __future__ import annotations

from typing import Any

GiB = 1 << 30


def capacity(gain: float = 0.08, startup_s: float = 1.0) -> dict[str, Any]:
    total = 80 * GiB

    def row(method: str, kv: int, budget: int) -> dict[str, Any]:
        return {"method": method, "num_blocks": kv // (2 << 20), "kv_bytes": kv,
                "transient": GiB // 2, "margin": GiB // 4 if method == "measured" else 0,
                "budget": budget, "startup_s": startup_s, "free_before": total - GiB,
                "free_after": total - GiB, "returned": True, "total": total,
                "weights": 2 * GiB, "non_torch": GiB // 8, "graphs_and_buffers": GiB // 4}

    estimate = 60 * GiB
    return {"device": "cpu", "args": {}, "results": [{
        "model": "tiny", "measured": row("measured", int(estimate * (1 + gain)), total),
        "estimate": row("estimate", estimate, int(total * 0.92)), "blocks_gain": gain,
        "startup_measured_s": startup_s, "startup_estimate_s": 1.5 * startup_s,
        "startup_ratio": 1 / 1.5, "memory_returned": True,
        "stages_measured": {"load_weights": 0.2 * startup_s, "warm_up": 0.5 * startup_s,
                            "size_kv_cache": 0.01 * startup_s, "total": 0.9 * startup_s},
        "stages_estimate": {"load_weights": 0.2 * startup_s, "warm_up": 1.0 * startup_s,
                            "total": 1.4 * startup_s}}]}


def throughput(tokens_per_s: float = 1000.0) -> dict[str, Any]:
    return {"device": "cpu", "copy_bandwidth_gbps": 100.0, "gemm_tflops": 2.0,
            "throughput": {"output_tokens_per_s": tokens_per_s,
                           "total_tokens_per_s": 2 * tokens_per_s, "of_limit": 0.8},
            "decode": [{"model": "tiny", "batch": b, "context": 64.0, "step_ms": 1.0 + b / 64,
                        "roofline_ms": 0.5 + b / 128, "ratio": 2.0, "sync_step_ms": 1.5 + b / 64}
                       for b in (1, 8, 64)],
            "ttft": [{"model": "tiny", "prompt_len": 64, "ttft_s": 0.02, "of_limit": 0.5}]}


def serving() -> dict[str, Any]:
    rows = [{"request_rate": rate, "output_throughput": 100.0 * i, "p50_ttft_ms": 10.0 * i,
             "p99_ttft_ms": 20.0 * i, "p50_itl_ms": 1.0 * i, "p99_itl_ms": 3.0 * i}
            for i, rate in enumerate((4, 16, None), start=1)]
    return {"serve": {"rows": rows}, "offline": {"output_throughput": 400.0}, "ratio": 0.75}


def sleep() -> dict[str, Any]:
    return {"model": "tiny", "ttft": {"best": {"external_hit_s": 0.01}},
            "components": {"kv_release_recommit_s_per_100GiB": 0.5, "offload_GBps": 20.0,
                           "restore_GBps": 25.0},
            "sleep": [{"level": lv, "cycle": 0, "sleep_s": 0.1 * lv, "wake_kv_s": 0.05,
                       "wake_weights_s": 0.2 * (lv - 1)} for lv in (1, 2)]}


def sampling() -> dict[str, Any]:
    return {"device": "cpu", "copy_gb_per_s": None,
            "sampling": [{"num_rows": 4, "kernel_ms": 0.1}],
            "filters": [{"setting": s, "num_rows": 8, "vocab_size": 4096, "sort_ms": 2.0,
                         "threshold_ms": 0.5, "speedup": 4.0} for s in ("k50 p0.9", "min_p0.05")]}


def adversarial() -> dict[str, Any]:
    runs = [{"run": name, "headroom_kept": GiB, "need_reserved": GiB // (i + 2)}
            for i, name in enumerate(("temperature", "all"))]
    return {"device": "cpu", "args": {}, "sweeps": [{"model": "tiny", "max_model_len": 256,
                                                     "margin": "default", "runs": runs}],
            "summaries": [{"model": "tiny", "margin": "default", "worst_kept_over_peak_need": 2.0,
                           "ooms": 0, "errors": 0, "guard_events": 0}]}


def elastic() -> dict[str, Any]:
    samples = [{"t": t / 10, "kv_blocks": 100 - (50 if 3 <= t < 7 else 0), "free_bytes": GiB,
                "cotenant_bytes": GiB if 3 <= t < 7 else 0} for t in range(10)]
    return {"time_to_shrink_s": 0.3, "first_shrink_s": 0.2, "regrow_s": 0.4,
            "kv_blocks_before": 100, "failed": 0, "oom_guard_events": 0, "samples": samples}


def elastic_pair() -> dict[str, Any]:
    def engine(model: str, busy: int) -> dict[str, Any]:
        samples = [{"t": t / 2, "kv_blocks": 90 if t // 4 % 2 == busy else 10,
                    "kv_bytes": (9 if t // 4 % 2 == busy else 1) * GiB} for t in range(16)]
        return {"model": model, "output_tokens": 1000, "ttft_s": [0.1, 0.2],
                "samples": samples, "kv_cache_idle_shrinks": 2, "resizes": []}

    mode = {"output_tokens": 2000, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2,
            "engines": [engine("small", 0), engine("large", 1)]}
    return {"args": {"phase_s": 2.0, "num_phases": 4},
            "modes": {"static": mode, "elastic": {**mode, "output_tokens": 2800}},
            "token_ratio": 1.4}


def async_engine() -> dict[str, Any]:
    rows = [{"engine": e, "seconds": 2.0, "output_throughput": 500.0, "ratio": 0.5}
            for e in ("process", "thread")]
    return {"args": {}, "offline": {"seconds": 1.0, "output_throughput": 1000.0}, "rows": rows}


def kv_dtype() -> dict[str, Any]:
    def run(name: str, dtype: str, blocks: int, tokens_per_s: float, step_ms: float) -> dict:
        return {"model": "tiny", "kv_cache_dtype": name, "dtype": dtype, "num_blocks": blocks,
                "block_bytes": 2 * GiB // blocks, "kv_bytes": 2 * GiB,
                "throughput": {"output_tokens_per_s": tokens_per_s},
                "decode": [{"batch": 64, "context": 4096.0, "step_ms": step_ms}]}

    engine = [run("auto", "bfloat16", 1000, 1000.0, 4.0),
              run("fp8", "float8_e4m3fn", 2000, 1500.0, 3.0)]
    variant = {"next_token_agreement": 0.995, "mean_kl": 0.004, "hf_top1": 0.99, "hf_top5": 1.0}
    return {"device": "cpu", "copy_bandwidth_gbps": 100.0, "kv_cache_dtypes": ["auto", "fp8"],
            "engine": engine,
            "ratios": {"blocks_ratio": 2.0, "throughput_ratio": 1.5,
                       "decode_batch64_speedup": 4 / 3},
            "accuracy": {"model": "tiny", "prompts": 2, "positions": 64,
                         "variants": {"auto": {**variant, "next_token_agreement": 1.0,
                                               "mean_kl": 0.0}, "fp8": variant}}}


def batch_invariant_gemm() -> dict[str, Any]:
    us = {"cublas": 10.0, "current": 14.0, "m128n128k64w8s3": 12.0}
    timings = [{"model": "tiny", "gemm": "qkv_proj", "n": 384, "k": 256, "m": m, "us": us,
                "over_cublas": {k: v / us["cublas"] for k, v in us.items() if k != "cublas"}}
               for m in (1, 64)]
    checks = [{"model": "tiny", "gemm": "qkv_proj", "kernel": k, "rows": 64, "config": None,
               "invariant": k != "cublas", "failures": [], "same_bits_as_current": k != "cublas"}
              for k in us]
    return {"device": "cpu", "dtype": "bf16", "shapes": [], "timings": timings,
            "checks": checks, "picks": []}


def skinny_linear() -> dict[str, Any]:
    us = {"cublas": 6.0, "skinny": 3.0, "unfused": 9.0, "fused": 3.5, "skinny_pdl": 2.5,
          "fused_pdl": 3.0, "skinny_mma": 4.0, "fused_mma": 3.75, "skinny_whole": 3.25}
    rows = [{"model": "qwen3-0.6b", "layer": "qkv_proj", "n": 4096, "k": 1024, "m": m,
             "prologue": "add_rms_norm", "weight_copies": 64, "us": us,
             "weight_gb_per_s": {k: 8.4e6 / (v * 1e3) for k, v in us.items()},
             "skinny_over_cublas": 0.5, "fused_over_unfused": 3.5 / 9.0} for m in (1, 16)]
    # past the skinny kernels' 16 rows: cuBLAS alone
    big = {"cublas": 8.0, "cublaslt": 6.0, "unfused": 10.0}
    rows.append({"model": "qwen3-0.6b", "layer": "qkv_proj", "n": 4096, "k": 1024, "m": 256,
                 "prologue": "add_rms_norm", "weight_copies": 64, "us": big,
                 "weight_gb_per_s": {k: 8.4e6 / (v * 1e3) for k, v in big.items()},
                 "limit_us": 4.0, "cublas_over_limit": 2.0})
    return {"device": "cpu", "dtype": "bf16", "layers": rows}


def attention_batch_invariant() -> dict[str, Any]:
    return {"device": "cpu", "copy_gb_per_s": 100.0, "cases": [
        {"case": "decode", "batch": 256, "length": 1024, "default_ms": 0.1, "mode_ms": 0.3,
         "mode_over_default": 3.0, "candidates": []},
        {"case": "prefill", "batch": 8, "length": 1024, "default_ms": 0.5, "mode_ms": 0.6,
         "mode_over_default": 1.2}]}


def attention_decode_input() -> dict[str, Any]:
    return {"device": "cpu", "decode_input": [
        {"batch": 1, "context": 1024,
         "kernel_us": {"unfused": 12.0, "fused": 10.2, "fused_tickets": 10.0}}]}


def attention_mixed_decode() -> dict[str, Any]:
    return {"device": "cpu", "copy_gb_per_s": 3000.0, "mixed_decode": [
        {"batch": 256, "max_len": 2300, "kv_gb": 1.22, "batch_ms": 0.4411,
         "batch_of_copy": 0.92, "longest_first_ms": 0.4380, "longest_first_of_copy": 0.92,
         "shortest_first_ms": 0.4404, "shortest_first_of_copy": 0.92}]}


ALL = {"capacity": capacity, "throughput": throughput, "serving": serving, "sleep": sleep,
       "sampling": sampling, "adversarial": adversarial, "elastic": elastic,
       "elastic-pair": elastic_pair, "async-engine": async_engine, "kv-dtype": kv_dtype,
       "batch-invariant-gemm": batch_invariant_gemm, "skinny-linear": skinny_linear,
       "attention-batch-invariant": attention_batch_invariant,
       "attention-decode-input": attention_decode_input,
       "attention-mixed-decode": attention_mixed_decode}


def attention() -> dict[str, Any]:
    return {"device": "cpu", "copy_gb_per_s": 100.0,
            "decode": [{"batch": 64, "context": 4096, "ms": 0.5}],
            "prefill": [{"batch": 1, "length": 4096, "tflops": 300.0}]}


def vmm() -> dict[str, Any]:
    return {"device": "cpu", "growth_us_per_chunk": 20.0, "release_plus_recommit_s": 0.1,
            "vmm_gbps": 99.0, "bandwidth_ratio": 0.99}


def determinism() -> dict[str, Any]:
    return {"device": "cpu",
            "throughputs": [{"mode": "default", "output_tokens_per_s": 1000.0},
                            {"mode": "deterministic", "output_tokens_per_s": 800.0}],
            "checks": [{"mode": "deterministic", "model": "tiny", "prompts": 4,
                        "identical": {"batch": 4, "chunked": 3}}]}


def bench_throughput() -> dict[str, Any]:
    return {"requests_per_s": 2.0, "output_tokens_per_s": 64.0, "total_tokens_per_s": 128.0}


def bench_latency() -> dict[str, Any]:
    return {"latencies_s": [0.5, 0.6], "latency_mean_s": 0.55, "latency_p50_s": 0.55}


def bench_serve() -> dict[str, Any]:
    return {"request_throughput": 2.0, "output_throughput": 64.0, "p50_ttft_ms": 10.0,
            "p99_itl_ms": 2.0, "failed": 0}


# The other benches' payloads, kept out of `ALL` (each of whose benches also adapts from a bare
# result file): with `ALL`, every bench's record path but the sweeps'.
def host_overhead() -> dict[str, Any]:
    phases = {"schedule": 110.0, "prepare_inputs": 340.0}
    engine = {"host_step_us": 1240.0, "host_us_per_token": 5.5, "phases_us": phases}
    return {"python_ref_us": 2000.0, "offline": {**engine, "host_step_us": 1750.0},
            "served": {"engine": engine, "api": {"step_us": 2190.0, "us_per_token": 9.8,
                                                 "admit_us_per_request": 71.4}}}


OTHERS = {"attention": attention, "vmm": vmm, "determinism": determinism,
          "host-overhead": host_overhead,
          "bench-throughput": bench_throughput, "bench-latency": bench_latency,
          "bench-serve": bench_serve}
