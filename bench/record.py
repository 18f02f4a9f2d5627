"""Check benchmark records and show their figures.

    python3 bench/record.py $OUT/capacity.json docs/results/*.json

Every benchmark (the scripts here and `kvfit bench ...`) writes one record through
`kvfit.benchmarks` (`record_of` + `write_record`; the schema is in `kvfit.benchmarks.record`).
This prints each file's bench, date, machine and figures, adapting result files published before
records existed, and exits 1 if any file does not conform.
"""

from __future__ import annotations

import argparse
import sys

from kvfit.benchmarks.record import load_record


def describe(record: dict) -> str:
    """One line of provenance, then one per figure and limit."""
    gpu, rev = record["machine"]["gpu"] or "cpu", record["git"]["revision"] or "?"
    lines = [f"{record['bench']}  {record['date'] or '?'}  {gpu}  git {rev[:10]}"]
    for section in ("figures", "limits"):
        for name, f in record[section].items():
            lines.append(f"  {name}: {f['value']:.6g} {f['unit']} ({f['direction']} is better)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    bad = 0
    for path in p.parse_args(argv).files:
        try:
            print(f"{path}: {describe(load_record(path))}")
        except (OSError, ValueError, KeyError) as e:  # JSONDecodeError is a ValueError
            bad += 1
            print(f"{path}: {e}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
