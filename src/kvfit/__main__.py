"""`python -m kvfit` is the `kvfit` command."""

import sys

from kvfit.cli import main

if __name__ == "__main__":
    sys.exit(main())
