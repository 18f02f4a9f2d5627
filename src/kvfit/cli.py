"""kvfit: an LLM inference engine whose KV cache is sized from measured memory.

Commands: `serve` (OpenAI-compatible server), `generate` (offline completions), `chat`
(terminal chat with a server or a local model), `bench {throughput,latency,serve}`, `probe`
(whether the VMM-backed KV cache works here). `kvfit COMMAND --help` lists each one's flags.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvfit import __version__
from kvfit.commands import bench_offline, bench_serve, chat, generate
from kvfit.commands.common import Subparsers, check_vllm_flags
from kvfit.commands.config_file import apply_config_file

SERVER_EXTRA = "pip install 'kvfit[server]'"


def _add_serve(sub: Subparsers) -> None:
    """`serve` comes from the server package; without it (or its extra's dependencies) a
    stand-in says what to install."""
    try:
        from kvfit.server.serve import add_serve_parser
    except ImportError as e:
        reason = str(e)
        p = sub.add_parser("serve", help=f"OpenAI-compatible server (needs {SERVER_EXTRA})",
                           description=f"Unavailable here ({reason}); install {SERVER_EXTRA}.",
                           add_help=True)
        p.add_argument("args", nargs="*", help="the server's flags (ignored here)")

        def unavailable(args: argparse.Namespace) -> int:
            print(f"kvfit serve is unavailable: {reason}. Install the server extra: "
                  f"{SERVER_EXTRA}", file=sys.stderr)
            return 1

        # Any server flag given is accepted, so the message is the install hint.
        p.set_defaults(func=unavailable, accepts_unknown_args=True)
        return
    add_serve_parser(sub)


def _probe_device(text: str) -> str:
    """`--device` of `probe`: 'auto', 'cpu', 'cuda' or 'cuda:N' (anything else is a usage
    error, not a device whose VMM is "unavailable")."""
    kind, _, index = text.partition(":")
    # The CPU has no device index (the engine refuses 'cpu:1'; 'cpu:0' is the CPU, as torch's).
    if text in ("auto", "cpu", "cpu:0") or (
            kind == "cuda" and (not index or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {text!r}")


def _cmd_probe(args: argparse.Namespace) -> int:
    """Print the probe's report; exit status 1 when the VMM-backed cache is unusable there."""
    from kvfit.vmm.probe import probe

    report, reason = probe(args.device)
    print(report)
    return 0 if reason is None else 1


def build_parser() -> argparse.ArgumentParser:
    """The `kvfit` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="kvfit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    generate.add_parser(sub)
    chat.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks: offline throughput and latency, or a "
                           "load generator against a server",
                           description="Benchmarks. `kvfit bench MODE --help` for each mode.")
    modes = bench.add_subparsers(dest="bench_mode", required=True, metavar="MODE")
    bench_offline.add_parsers(modes)
    bench_serve.add_parser(modes)

    probe = sub.add_parser("probe", help="report whether the VMM-backed KV cache works here")
    probe.add_argument("--device", default="auto", type=_probe_device,
                       help="'auto' (cuda where there is one, else cpu), 'cpu', 'cuda' or "
                       "'cuda:N' (default: %(default)s)")
    probe.set_defaults(func=_cmd_probe)
    # A wrong flag is reported with the usage of the command it was given to, not kvfit's.
    for command in [*sub.choices.values(), *modes.choices.values()]:
        command.set_defaults(command_parser=command)
    return parser


def dashed_flags(argv: list[str]) -> list[str]:
    """Flags spelt with underscores (`--max_model_len 4096`, `--max_model_len=4096`), which
    vLLM's parser takes, as their dashed names; values, and all after a bare `--`, as given."""

    def dashed(arg: str) -> str:
        if not arg.startswith("--"):
            return arg
        name, eq, value = arg.partition("=")
        return name.replace("_", "-") + eq + value

    end = argv.index("--") if "--" in argv else len(argv)
    return [dashed(arg) for arg in argv[:end]] + argv[end:]


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the process's arguments) and run the command; its exit status."""
    argv = dashed_flags(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # Out of the namespace, which commands pickle into the processes they start.
    command_parser = vars(args).pop("command_parser", parser)
    if getattr(args, "config_file", None) is not None:
        # Its values become the command's defaults, so that the command line wins over them.
        apply_config_file(command_parser, args.config_file)
        args, unknown = parser.parse_known_args(argv)
        vars(args).pop("command_parser", None)
    # serve without its extra takes any flag: its message is the install hint.
    if not getattr(args, "accepts_unknown_args", False) and (
            unknown := check_vllm_flags(parser, unknown)):
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "check_args"):
        args.check_args(args)  # flags that are wrong together: a usage error, nothing loaded
    status = args.func(args)
    return 0 if status is None else int(status)


def run() -> int:
    """The `kvfit` program: `main`, with an error in a setting or an input (`ValueError`,
    `FileNotFoundError`, whose messages name what to change) shown as one line and exit status
    1 instead of a traceback. `KVFIT_TRACEBACK=1` shows the traceback. Ctrl-C exits with
    status 130 and output to a closed pipe (`| head -1`) with 141, each without a traceback:
    the statuses a shell reports for SIGINT and SIGPIPE."""
    try:
        return main()
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("KVFIT_TRACEBACK") == "1":
            raise
        print(f"kvfit: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvfit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Python flushes stdout again at exit, into the same closed pipe: point it elsewhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(run())
