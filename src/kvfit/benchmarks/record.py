"""One JSON record per benchmark run: its figures, configuration, machine, versions and revision.

A record is a plain dict:

    schema_version  RECORD_SCHEMA_VERSION
    bench           the benchmark's name ("capacity", "throughput", "bench-serve", ...)
    date            UTC, ISO 8601 (None for a published file that did not carry one)
    git             {"revision": sha or None, "dirty": bool or None}
    machine         {"gpu", "gpu_memory_bytes", "cpu", "host"} (None where unknown)
    versions        {"python", "torch", "cuda", "driver", "triton", "transformers"}
    config          the arguments the run was given
    limits          in-run limit figures the bench measured (copy bandwidth, GEMM throughput)
    figures         name -> {"value": number, "unit": str, "direction": "higher" | "lower"}
    results         the benchmark's own detailed payload, unchanged

`figures` and `limits` hold the numbers `bench/compare.py` compares; `direction` says which way
is better, so a move the other way beyond the noise is a regression.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

RECORD_SCHEMA_VERSION = 1
DIRECTIONS = ("higher", "lower")
_SECTIONS = {"git": ("revision", "dirty"),
             "machine": ("gpu", "gpu_memory_bytes", "cpu", "host"),
             "versions": ("python", "torch", "cuda", "driver", "triton", "transformers")}
_REPO = Path(__file__).resolve().parents[3]


def figure(value: float, unit: str, direction: str) -> dict[str, Any]:
    """One figure of a record; `direction` is the way that is better."""
    return {"value": value, "unit": unit, "direction": direction}


def _run(cmd: list[str]) -> str | None:
    """A command's stripped stdout, or None where it is missing or fails."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(repo: Path = _REPO) -> dict[str, Any]:
    """The revision the run's sources are at, and whether tracked files differ from it.

    `KVFIT_GIT_REVISION`, where set, names it instead (whether the tree is dirty is then
    unknown: None): a GPU machine's copy of the tree has no `.git`, or one whose HEAD is
    stale (the device tool's copies named a revision two sessions old).
    """
    if named := os.environ.get("KVFIT_GIT_REVISION"):
        return {"revision": named, "dirty": None}
    revision = _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
    if revision is None:
        return {"revision": None, "dirty": None}
    status = _run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    return {"revision": revision, "dirty": status is not None}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """The GPU (name, total memory) where CUDA is up, the CPU and the host name."""
    gpu = memory = None
    torch = sys.modules.get("torch")  # never import torch (and start CUDA) just to describe it
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu, memory = props.name, props.total_memory
    return {"gpu": gpu, "gpu_memory_bytes": memory, "cpu": _cpu_name(),
            "host": socket.gethostname()}


def versions() -> dict[str, Any]:
    """Versions of what the figures depend on; the driver's from nvidia-smi where present."""
    torch = sys.modules.get("torch")
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"python": platform.python_version(),
            "torch": getattr(torch, "__version__", None) or _version("torch"),
            "cuda": getattr(getattr(torch, "version", None), "cuda", None),
            "driver": driver.splitlines()[0] if driver else None,
            "triton": _version("triton"), "transformers": _version("transformers")}


def make_record(bench: str, figures: dict[str, dict[str, Any]], config: dict[str, Any],
                results: Any, limits: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A validated record of a run that just finished on this machine."""
    record = {
        "schema_version": RECORD_SCHEMA_VERSION, "bench": bench,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": git_state(), "machine": machine_info(), "versions": versions(),
        "config": jsonable(config), "limits": limits or {}, "figures": figures,
        "results": results,  # as the bench wrote it before records (infinity and all)
    }
    check(record)
    return record


def jsonable(value: Any) -> Any:
    """`value` as strict JSON can hold it: an infinite float or an object becomes its string,
    a function or class its qualified name."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    if callable(value) and hasattr(value, "__qualname__"):
        # A handler argparse keeps (`kvfit bench`'s args.func): by name, as its repr holds a
        # memory address that differs between runs and reads as a config that changed.
        return f"{value.__module__}.{value.__qualname__}"
    return str(value)  # a Path, an enum


def write_record(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Check `record` and write it to `path` as indented JSON."""
    check(record)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def load_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A record from `path`; an older published result file is adapted (see `figures.adapt`)."""
    from kvfit.benchmarks.figures import adapt

    data = json.loads(Path(path).read_text())
    record = data if isinstance(data, dict) and "schema_version" in data else adapt(data, path)
    check(record)
    return record


def _check_figures(where: str, figures: Any) -> list[str]:
    if not isinstance(figures, dict):
        return [f"{where}: expected an object, got {type(figures).__name__}"]
    errors = []
    for name, f in figures.items():
        if not isinstance(f, dict) or set(f) != {"value", "unit", "direction"}:
            errors.append(f"{where}.{name}: expected exactly value, unit, direction")
            continue
        value = f["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            errors.append(f"{where}.{name}.value: expected a finite number, got {value!r}")
        if not isinstance(f["unit"], str):
            errors.append(f"{where}.{name}.unit: expected a string")
        if f["direction"] not in DIRECTIONS:
            errors.append(f"{where}.{name}.direction: expected one of {DIRECTIONS}, "
                          f"got {f['direction']!r}")
    return errors


def validate(record: Any) -> list[str]:
    """Every way `record` departs from the schema; empty when it conforms."""
    if not isinstance(record, dict):
        return [f"a record is a JSON object, got {type(record).__name__}"]
    required = {"schema_version", "bench", "date", "config", "limits", "figures", "results",
                *_SECTIONS}
    errors = [f"missing key {k!r}" for k in sorted(required - set(record))]
    errors += [f"unknown key {k!r}" for k in sorted(set(record) - required)]
    if errors:
        return errors
    if record["schema_version"] != RECORD_SCHEMA_VERSION:
        errors.append(f"schema_version: expected {RECORD_SCHEMA_VERSION}, "
                      f"got {record['schema_version']!r}")
    if not isinstance(record["bench"], str) or not record["bench"]:
        errors.append("bench: expected a non-empty string")
    if record["date"] is not None:
        try:
            datetime.datetime.fromisoformat(record["date"])
        except (TypeError, ValueError):
            errors.append(f"date: expected ISO 8601 or null, got {record['date']!r}")
    for section, keys in _SECTIONS.items():
        value = record[section]
        if not isinstance(value, dict) or set(value) != set(keys):
            errors.append(f"{section}: expected an object with exactly {', '.join(keys)}")
    if not isinstance(record["config"], dict):
        errors.append("config: expected an object")
    errors += _check_figures("figures", record["figures"])
    errors += _check_figures("limits", record["limits"])
    return errors


def check(record: Any) -> None:
    """Raise ValueError listing every schema violation of `record`."""
    errors = validate(record)
    if errors:
        raise ValueError("invalid benchmark record: " + "; ".join(errors))
