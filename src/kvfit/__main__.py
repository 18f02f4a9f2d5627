"""`python -m kvfit` is the `kvfit` command."""

import sys

from kvfit.cli import run

if __name__ == "__main__":
    sys.exit(run())
