"""`kvfit` command line: `generate`, `probe` (and more as the engine grows)."""

from __future__ import annotations

import argparse
import sys


def _cmd_probe(args: argparse.Namespace) -> int:
    from kvfit.vmm.probe import probe_report

    print(probe_report(args.device))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    probe = sub.add_parser("probe", help="report whether the VMM-backed KV cache works here")
    probe.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda' or 'cuda:N'")
    probe.set_defaults(func=_cmd_probe)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
