"""`kvfit` command line: `generate`, `probe` (and more as the engine grows)."""

from __future__ import annotations

import argparse
import sys


def _cmd_probe(args: argparse.Namespace) -> int:
    from kvfit.vmm.probe import probe_report

    print(probe_report(args.device))
    return 0


_DEFAULT_PROMPTS = ("Hello, my name is", "The capital of France is", "The future of AI is")


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvfit.engine.config import EngineArgs
    from kvfit.engine.llm import LLM
    from kvfit.engine.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    prompts: list = [{"prompt_token_ids": ids} for ids in args.prompt_token_ids or []]
    prompts += args.prompt or []
    if not prompts:
        prompts = list(_DEFAULT_PROMPTS) if llm.get_tokenizer() else [{"prompt_token_ids": [1]}]
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed, stop=args.stop or [], max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    for out in llm.generate(prompts, params):
        prompt = out.prompt if out.prompt is not None else out.prompt_token_ids
        print(f"prompt: {prompt!r}")
        for completion in out.outputs:
            text = completion.text if llm.get_tokenizer() else completion.token_ids
            print(f"completion: {text!r} ({completion.finish_reason})")
        print()
    print(llm.kv_cache_report)
    return 0


def _token_ids(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from kvfit.engine.config import EngineArgs

    gen = sub.add_parser("generate", help="generate completions (default model: kvfit-tiny)")
    gen.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    gen.add_argument("--prompt-token-ids", action="append", type=_token_ids,
                     help="a prompt as comma-separated token ids (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)

    probe = sub.add_parser("probe", help="report whether the VMM-backed KV cache works here")
    probe.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda' or 'cuda:N'")
    probe.set_defaults(func=_cmd_probe)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
