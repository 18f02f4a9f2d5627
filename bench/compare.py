"""Compare two benchmark records figure by figure; flag what got worse beyond the noise.

    python3 bench/compare.py docs/results/capacity-h200-2026-12-03.json $OUT/capacity.json
    python3 bench/compare.py A.json B.json --threshold 0.10

Prints every figure (and in-run limit) the two share with its ratio B/A, and flags those that
moved more than `--threshold` (a fraction) in the wrong direction for that figure: down for a
figure where higher is better, up for one where lower is better. Exit status 1 when any is
flagged. Either file may be a record or a result file published before records existed.
The limits (copy bandwidth, GEMM throughput) are shown, never flagged: they say whether the
machine itself moved.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any

from kvfit.benchmarks.record import load_record


@dataclass(frozen=True)
class Change:
    """One shared figure: its values in A and B, B/A, and whether it is a regression."""

    name: str
    unit: str
    direction: str
    a: float
    b: float
    flagged: bool

    @property
    def ratio(self) -> float:
        if self.a == 0:
            return 1.0 if self.b == 0 else math.inf
        return self.b / self.a


def worse(a: float, b: float, direction: str, threshold: float) -> bool:
    """Whether going from `a` to `b` is a regression beyond `threshold` (a fraction of `a`).

    Relative to |a|, so a count that was 0 (OOMs, failures) is flagged on any rise.
    """
    change = (b - a) if direction == "higher" else (a - b)
    return change < 0 and -change > threshold * abs(a)


def compare(a: dict[str, Any], b: dict[str, Any], threshold: float,
            section: str = "figures") -> list[Change]:
    """The figures of `section` that both records have, in A's order (B's direction wins)."""
    fa, fb = a[section], b[section]
    return [Change(name, fb[name]["unit"], fb[name]["direction"], fa[name]["value"],
                   fb[name]["value"],
                   section == "figures" and fa[name]["unit"] == fb[name]["unit"]
                   and worse(fa[name]["value"], fb[name]["value"], fb[name]["direction"],
                             threshold))
            for name in fa if name in fb]


def mismatches(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Shared figures whose unit or direction differ between the records: a unit that
    differs makes B/A meaningless (not flagged); a direction that differs is judged by B's."""
    lines = []
    for name, fa in a["figures"].items():
        fb = b["figures"].get(name)
        if fb is None:
            continue
        if fa["unit"] != fb["unit"]:
            lines.append(f"{name}: unit {fa['unit']!r} in A, {fb['unit']!r} in B "
                         "(B/A not comparable, never flagged)")
        if fa["direction"] != fb["direction"]:
            lines.append(f"{name}: {fa['direction']} is better in A, {fb['direction']} in B "
                         "(judged by B's)")
    return lines


# Config keys that name where a run wrote its output, not what it ran.
_OUTPUT_KEYS = frozenset({"out", "result_file", "out_dir", "save_result", "result_dir",
                          "result_filename"})


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """How the two runs differ in what they ran (config) and where (machine): each one makes
    the ratios less of a like-for-like comparison. Unknown (None) machine fields are skipped."""
    lines = []
    ca, cb = a["config"], b["config"]
    changed = [f"{k} {ca[k]!r} -> {cb[k]!r}" for k in ca
               if k in cb and k not in _OUTPUT_KEYS and ca[k] != cb[k]]
    if changed:
        lines.append("different configs: " + ", ".join(changed))
    one_side = sorted((set(ca) ^ set(cb)) - _OUTPUT_KEYS)
    if one_side and ca and cb:  # an empty config: a published file that kept none
        lines.append("config keys in one record only: " + ", ".join(one_side))
    ma, mb = a["machine"], b["machine"]
    moved = [f"{k} {ma[k]!r} -> {mb[k]!r}" for k in ma
             if ma.get(k) is not None and mb.get(k) is not None and ma[k] != mb[k]]
    if moved or bool(ma.get("gpu")) != bool(mb.get("gpu")):
        if not moved:
            moved = [f"gpu {ma.get('gpu')!r} -> {mb.get('gpu')!r}"]
        lines.append("different machines: " + ", ".join(moved))
    return lines


def _load(p: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The record at `path`; a file that is missing, not JSON or not a record is a usage error
    (exit 2) naming it, never a traceback with exit 1, which would read as a regression."""
    try:
        return load_record(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        p.error(f"{path}: {e}")


def _describe(r: dict[str, Any]) -> str:
    rev = (r["git"]["revision"] or "?")[:10] + ("+dirty" if r["git"]["dirty"] else "")
    return f"{r['bench']}  {r['date'] or '?'}  {r['machine']['gpu'] or 'cpu'}  git {rev}"


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def format_table(changes: list[Change]) -> str:
    width = max((len(c.name) for c in changes), default=6)
    lines = [f"{'figure':<{width}} {'A':>12} {'B':>12} {'B/A':>7}  better  unit"]
    for c in changes:
        lines.append(f"{c.name:<{width}} {_num(c.a):>12} {_num(c.b):>12} {c.ratio:>7.3f}  "
                     f"{c.direction:<6}  {c.unit}{'  <-- worse' if c.flagged else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="the reference record (the last published one)")
    p.add_argument("b", help="the new record")
    p.add_argument("--threshold", type=float, default=0.05,
                   help="noise: a move the wrong way by more than this fraction is flagged")
    args = p.parse_args(argv)
    if not math.isfinite(args.threshold) or args.threshold < 0:  # nan would flag nothing
        p.error(f"--threshold must be a finite fraction >= 0, got {args.threshold}")
    a, b = _load(p, args.a), _load(p, args.b)
    if a["bench"] != b["bench"]:
        p.error(f"different benches: {a['bench']} vs {b['bench']}")
    print(f"A: {_describe(a)}\nB: {_describe(b)}\n")
    for line in differences(a, b) + mismatches(a, b):
        print(f"warning: {line}")
    changes = compare(a, b, args.threshold)
    if not changes and (a["figures"] or b["figures"]):
        # Exit 0 here says nothing about regressions: other models, shapes or sections ran.
        print("warning: the records share no figure: nothing was compared")
    print(format_table(changes))
    limits = compare(a, b, args.threshold, "limits")
    if limits:
        print("\nin-run limits (the machine, not the code):\n" + format_table(limits))
    for side, mine, other in (("A", a, b), ("B", b, a)):
        only = [name for name in mine["figures"] if name not in other["figures"]]
        if only:
            print(f"\nin one record only (not compared), in {side} only: {', '.join(only)}")
    flagged = [c.name for c in changes if c.flagged]
    print(f"\n{len(changes)} figures compared, {len(flagged)} worse by more than "
          f"{args.threshold:.0%}" + (f": {', '.join(flagged)}" if flagged else ""))
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
