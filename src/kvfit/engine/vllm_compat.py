"""vLLM's settings that kvfit does not take, or takes as no-ops: one table for the command
line's flags and `LLM(...)`'s keyword arguments (the flag's name with `_` for `-`), each with
what to do instead, so that a vLLM command line or script stops with the reason."""

_LOCAL_ONLY = ("kvfit loads a local folder and downloads nothing: fetch that revision into a "
               "folder and pass it as the model")
_NO_TOOLS = "tool calling and reasoning parsers are not supported"
_NO_STRUCTURED_OUTPUT = "structured output (guided decoding) is not built in kvfit"
_ONE_DATA_PARALLEL = "run one kvfit per device group behind a load balancer"
_ONE_HOST = "kvfit runs on one host: --tensor-parallel-size splits the model over its devices"
_NO_LORA = "LoRA adapters are not supported; merge the adapter into the weights"
_TEXT_ONLY = "kvfit serves text-only models"
_MODEL_CONFIG = ("kvfit reads the model folder's config.json as it is: edit it (or a copy of "
                 "the folder) instead")
_OWN_LOADER = ("kvfit loads the model folder's safetensors itself; --load-format picks "
               "safetensors or dummy weights")
_SERVE_LOGS_REQUESTS = "only kvfit serve logs requests: pass it --enable-log-requests"
_NO_TLS = "serve plain HTTP behind a proxy that terminates TLS"
# vLLM flags kvfit does not do, each with what to do instead: a vLLM command line pasted here
# stops with the reason, not argparse's bare 'unrecognized arguments'.
VLLM_UNSUPPORTED_FLAGS = {
    **dict.fromkeys(("--quantization", "-q"), "kvfit runs unquantized checkpoints (float32, "
                    "bfloat16, float16); only the KV cache can be fp8 (--kv-cache-dtype fp8)"),
    **dict.fromkeys(("--pipeline-parallel-size", "-pp"), "the model splits over devices by "
                    "tensor parallelism only: --tensor-parallel-size"),
    **dict.fromkeys(("--data-parallel-size", "-dp", "--data-parallel-size-local", "-dpl",
                     "--data-parallel-rank", "-dpn", "--data-parallel-start-rank", "-dpr",
                     "--data-parallel-address", "-dpa", "--data-parallel-rpc-port", "-dpp",
                     "--data-parallel-backend", "-dpb", "--data-parallel-hybrid-lb",
                     "--data-parallel-external-lb", "--headless"), _ONE_DATA_PARALLEL),
    **dict.fromkeys(("--nnodes", "--node-rank", "--master-addr", "--master-port"), _ONE_HOST),
    **dict.fromkeys(("--enable-expert-parallel", "-ep", "--enable-eplb", "--eplb-config"),
                    "expert parallelism is not supported: --tensor-parallel-size splits the "
                    "model"),
    **dict.fromkeys(("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank",
                     "--max-cpu-loras", "--lora-dtype", "--fully-sharded-loras",
                     "--enable-lora-bias", "--lora-extra-vocab-size", "--default-mm-loras"),
                    _NO_LORA),
    **dict.fromkeys(("--structured-outputs-config", "--guided-decoding-backend",
                     "--guided-decoding-disable-fallback",
                     "--guided-decoding-disable-any-whitespace"), _NO_STRUCTURED_OUTPUT),
    **dict.fromkeys(("--hf-overrides", "--rope-scaling", "--rope-theta", "--hf-config-path",
                     "--config-format"), _MODEL_CONFIG),
    **dict.fromkeys(("--model-loader-extra-config", "--ignore-patterns",
                     "--safetensors-load-strategy", "--pt-load-map-location",
                     "--max-parallel-loading-workers"), _OWN_LOADER),
    **dict.fromkeys(("--task", "--runner", "--convert", "--pooler-config",
                     "--override-pooler-config"), "kvfit runs generative text models only "
                    "(no pooling or embedding runners): drop the flag"),
    "--model-impl": "kvfit runs its own implementation of each architecture it knows: drop "
                    "the flag",
    **dict.fromkeys(("--worker-cls", "--worker-extension-cls", "--scheduler-cls"),
                    "kvfit's workers and scheduler are its own (--scheduling-policy picks "
                    "the order requests run in)"),
    "--skip-tokenizer-init": "kvfit needs the model's tokenizer (answers are text, stop "
                             "strings are matched on it): drop the flag",
    "--enable-prompt-embeds": "prompt embeddings are not supported: send text or token ids",
    **dict.fromkeys(("--logits-processors", "--logits-processor-pattern"),
                    "custom logits processors are not supported"),
    "--num-lookahead-slots": "speculative decoding is not supported",
    "--disable-sliding-window": "kvfit runs full attention only; a model with a sliding "
                                "window serves up to it: pass --max-model-len WINDOW",
    **dict.fromkeys(("--max-num-partial-prefills", "--max-long-partial-prefills"),
                    "kvfit chunks prefills under --max-num-batched-tokens; "
                    "--long-prefill-token-threshold caps one prefill's chunk"),
    "--prefix-caching-hash-algo": "kvfit's prefix cache keys blocks by a hash of its own",
    "--enable-per-request-metrics": "answers carry no per-request timings; /metrics serves "
                                    "them as histograms",
    "--tokens-only": "kvfit serves its whole OpenAI-compatible API",
    **dict.fromkeys(("--decode-context-parallel-size", "-dcp",
                     "--prefill-context-parallel-size", "-pcp"),
                    "context parallelism is not supported: --tensor-parallel-size splits the "
                    "model"),
    **dict.fromkeys(("--all2all-backend", "--num-redundant-experts",
                     "--expert-placement-strategy"), "expert parallelism is not supported: "
                    "--tensor-parallel-size splits the model"),
    **dict.fromkeys(("--enable-dbo", "--ubatch-size", "--dbo-decode-token-threshold",
                     "--dbo-prefill-token-threshold"),
                    "dual-batch overlap (micro-batching) is not supported"),
    "--attention-backend": "kvfit runs its own attention kernels: drop the flag",
    "--override-attention-dtype": "attention runs in the model's --dtype",
    **dict.fromkeys(("--mamba-cache-dtype", "--mamba-ssm-cache-dtype"),
                    "kvfit runs attention-only models (no Mamba layers); --kv-cache-dtype "
                    "sets the KV cache's"),
    "--kv-sharing-fast-prefill": "kvfit's layers share no KV cache",
    "--io-processor-plugin": "kvfit runs generative text models only (no pooling or "
                             "embedding runners): drop the flag",
    "--ec-transfer-config": _TEXT_ONLY,
    **dict.fromkeys(("--fingerprint-mode", "--fingerprint-value"),
                    "kvfit's answers carry no system_fingerprint"),
    **dict.fromkeys(("--data-parallel-supervisor-port", "--dp-supervisor-probe-interval-s",
                     "--dp-supervisor-probe-timeout-s",
                     "--dp-supervisor-probe-failure-threshold"), _ONE_DATA_PARALLEL),
    "--enable-offline-docs": "the /docs page loads its assets from a CDN; "
                             "--disable-fastapi-docs turns it off",
    **dict.fromkeys(("--otlp-traces-endpoint", "--collect-detailed-traces"),
                    "OpenTelemetry tracing is not supported; /metrics serves the Prometheus "
                    "figures"),
    "--kv-events-config": "KV cache events are not published",
    "--additional-config": "kvfit has no platform plug-ins to configure",
    "--show-hidden-metrics-for-version": "kvfit hides no metrics: drop the flag",
    "--uds": "kvfit listens on TCP only: --host and --port",
    "--grpc": "kvfit serves HTTP only",
    "--middleware": "kvfit adds no ASGI middleware of the user's; put it in a proxy in front",
    "--enable-tokenizer-info-endpoint": "there is no /tokenizer_info route (/tokenize and "
                                        "/detokenize are served)",
    "--enable-server-load-tracking": "there is no server load figure; /metrics has the "
                                     "running and waiting requests",
    "--log-config-file": "kvfit takes no logging config file; --uvicorn-log-level sets "
                         "uvicorn's level",
    # kvfit serve's flags; refused by the other commands and LLM(...).
    **dict.fromkeys(("--enable-log-requests", "--no-disable-log-requests"),
                    _SERVE_LOGS_REQUESTS),
    "--enable-log-outputs": "only kvfit serve logs outputs: pass it --enable-log-requests "
                            "--enable-log-outputs",
    "--trust-request-chat-template": "a request may not bring its own chat template: start "
                                     "the server with --chat-template",
    **dict.fromkeys(("--tool-parser-plugin", "--tool-server",
                     "--exclude-tools-when-tool-choice-none", "--reasoning-parser-plugin"),
                    _NO_TOOLS),
    **dict.fromkeys(("--limit-mm-per-prompt", "--mm-processor-kwargs", "--media-io-kwargs",
                     "--mm-processor-cache-gb", "--disable-mm-preprocessor-cache",
                     "--mm-processor-cache-type", "--mm-encoder-tp-mode",
                     "--interleave-mm-strings", "--skip-mm-profiling",
                     "--allowed-local-media-path", "--allowed-media-domains"), _TEXT_ONLY),
    **dict.fromkeys(("--h11-max-incomplete-event-size", "--h11-max-header-count"),
                    "kvfit runs uvicorn at h11's own limits; --max-request-body-bytes bounds "
                    "request bodies"),
    **dict.fromkeys(("--speculative-config", "--speculative-model", "--num-speculative-tokens",
                     "--speculative-draft-tensor-parallel-size", "--ngram-prompt-lookup-max",
                     "--ngram-prompt-lookup-min"), "speculative decoding is not supported"),
    "--num-scheduler-steps": "multi-step scheduling is not supported: drop the flag",
    "--preemption-mode": "kvfit always preempts a request by recomputing its KV cache: drop "
                         "the flag",
    "--override-generation-config": "edit generation_config.json, or pass "
                                    "--generation-config FOLDER holding another",
    "--config": "only kvfit serve reads a YAML --config file; pass the settings as flags",
    **dict.fromkeys(("--revision", "--tokenizer-revision", "--code-revision", "--download-dir",
                     "--hf-token"), _LOCAL_ONLY),
    "--tokenizer-mode": "kvfit uses the fast tokenizer (tokenizer.json) of --tokenizer or the "
                        "model folder",
    "--cpu-offload-gb": "weights and the KV cache stay on the device; lower --max-model-len "
                        "or --max-num-seqs to fit",
    "--swap-space": "kvfit preempts a request by recomputing its KV cache, never by swapping "
                    "it to CPU memory; lower --max-num-seqs to preempt less",
    **dict.fromkeys(("--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
                     "--enable-reasoning"), _NO_TOOLS),
    **dict.fromkeys(("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs",
                     "--ssl-ciphers", "--enable-ssl-refresh"), _NO_TLS),
    "--max-seq-len-to-capture": "--cuda-graph-sizes sets the batch sizes captured",
    **dict.fromkeys(("--compilation-config", "-O"), "kvfit does not use torch.compile; "
                    "--cudagraph-mode picks the CUDA graphs"),
    "--kv-transfer-config": "--kv-connector and --kv-connector-path",
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
    # kvfit serve's flags (its default); taken by the other commands and LLM(...).
    **dict.fromkeys(("--disable-log-requests", "--no-enable-log-requests"),
                    "only kvfit serve logs requests, with --enable-log-requests"),
    "--no-enable-log-outputs": "only kvfit serve logs outputs, with --enable-log-outputs",
    "--enable-chunked-prefill": "kvfit always chunks long prefills under "
                                "--max-num-batched-tokens",
    "--no-trust-remote-code": "kvfit never runs a model folder's code",
    "--async-scheduling": "kvfit schedules each step once the last one's tokens are in; the "
                          "outputs are the same",
    "--aggregate-engine-logging": "kvfit runs one engine: its figures are the aggregate",
    "--disable-custom-all-reduce": "kvfit's tensor parallelism all-reduces through "
                                   "torch.distributed, never a custom kernel",
    "--disable-cascade-attn": "kvfit has no cascade attention",
    "--disable-hybrid-kv-cache-manager": "kvfit's KV cache is of one kind for every layer",
    "--disable-chunked-mm-input": "kvfit serves text-only models",
    "--use-v2-block-manager": "kvfit has one block manager",
    **dict.fromkeys(("--use-tqdm-on-load", "--no-use-tqdm-on-load"),
                    "kvfit logs its loading stages instead"),
    **dict.fromkeys(("--enable-log-deltas", "--no-enable-log-deltas"),
                    "--enable-log-outputs logs a stream's output whole as it ends, never its "
                    "pieces"),
}
# VLLM_UNSUPPORTED_FLAGS taking a value, at the values that ask for what kvfit does (vLLM's
# defaults, often spelt out in guides: `--tokenizer-mode auto`, `--task generate`): taken, as
# engine flags (value and all, so that a MODEL after them is not taken for their value); any
# other value is refused with the flag's reason.
VLLM_NOOP_VALUES: dict[str, tuple[str, ...]] = {
    "--tokenizer-mode": ("auto", "hf"),
    "--model-impl": ("auto",),
    "--task": ("auto", "generate"),
    "--runner": ("auto", "generate"),
    "--convert": ("auto", "none"),
    "--preemption-mode": ("recompute",),
}


def vllm_noop_dest(flag: str) -> str:
    """The argparse dest of a vLLM flag taken with its value as a no-op (`VLLM_NOOP_VALUES`):
    apart from kvfit's own settings, present only where given."""
    return "vllm_noop_" + flag.lstrip("-").replace("-", "_")
