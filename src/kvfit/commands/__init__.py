"""The `kvfit` subcommands, one module each; `kvfit.cli` wires them into one parser.

Each module exposes `add_parser(subparsers)`, which registers its subcommand and sets `func` to
a function taking the parsed namespace and returning the exit status. The engine and the HTTP
clients are imported inside those functions, so a command does not pay for another's
dependencies.
"""
