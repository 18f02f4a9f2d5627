"""vLLM's settings that kvfit does not take, or takes as no-ops: one table for the command
line's flags and `LLM(...)`'s keyword arguments (the flag's name with `_` for `-`), each with
what to do instead, so that a vLLM command line or script stops with the reason."""

_LOCAL_ONLY = ("kvfit loads a local folder and downloads nothing: fetch that revision into a "
               "folder and pass it as the model")
_NO_TOOLS = "tool calling and reasoning parsers are not supported"
# vLLM flags kvfit does not do, each with what to do instead: a vLLM command line pasted here
# stops with the reason, not argparse's bare 'unrecognized arguments'.
VLLM_UNSUPPORTED_FLAGS = {
    **dict.fromkeys(("--quantization", "-q"), "kvfit runs unquantized checkpoints (float32, "
                    "bfloat16, float16); only the KV cache can be fp8 (--kv-cache-dtype fp8)"),
    **dict.fromkeys(("--pipeline-parallel-size", "-pp"), "the model splits over devices by "
                    "tensor parallelism only: --tensor-parallel-size"),
    **dict.fromkeys(("--data-parallel-size", "-dp"), "run one kvfit per device group behind a "
                    "load balancer"),
    **dict.fromkeys(("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"),
                    "LoRA adapters are not supported; merge the adapter into the weights"),
    "--speculative-config": "speculative decoding is not supported",
    "--override-generation-config": "edit generation_config.json, or pass "
                                    "--generation-config FOLDER holding another",
    "--config": "there is no YAML config file; pass the settings as flags",
    "--enable-log-requests": "kvfit has no request log; the engine's figures are logged every "
                             "10 s (--disable-log-stats turns them off)",
    **dict.fromkeys(("--revision", "--tokenizer-revision", "--code-revision", "--download-dir",
                     "--hf-token"), _LOCAL_ONLY),
    "--tokenizer-mode": "kvfit uses the fast tokenizer (tokenizer.json) of --tokenizer or the "
                        "model folder",
    "--cpu-offload-gb": "weights and the KV cache stay on the device; lower --max-model-len "
                        "or --max-num-seqs to fit",
    "--swap-space": "kvfit preempts a request by recomputing its KV cache, never by swapping "
                    "it to CPU memory; lower --max-num-seqs to preempt less",
    **dict.fromkeys(("--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"),
                    _NO_TOOLS),
    **dict.fromkeys(("--ssl-keyfile", "--ssl-certfile"), "serve plain HTTP behind a proxy that "
                    "terminates TLS"),
    "--max-seq-len-to-capture": "--cuda-graph-sizes sets the batch sizes captured",
    **dict.fromkeys(("--compilation-config", "-O"), "kvfit does not use torch.compile; "
                    "--cudagraph-mode picks the CUDA graphs"),
    "--kv-transfer-config": "--kv-connector and --kv-connector-path",
    "--limit-mm-per-prompt": "kvfit serves text-only models",
    "--no-enable-chunked-prefill": "kvfit always chunks long prefills under "
                                   "--max-num-batched-tokens",
}
# `LLM(...)` keyword arguments of VLLM_UNSUPPORTED_FLAGS taken at vLLM's default value, which
# scripts pass explicitly: it asks for nothing kvfit would have to do.
VLLM_DEFAULT_VALUES = {"swap_space": 4}
# vLLM flags (without a value) that ask for what kvfit does anyway: taken, with a note.
VLLM_NOOP_FLAGS = {
    "--trust-remote-code": "kvfit runs its own code for the architectures it knows, never a "
                           "model folder's",
    "--disable-log-requests": "kvfit has no request log",
    "--enable-chunked-prefill": "kvfit always chunks long prefills under "
                                "--max-num-batched-tokens",
}
