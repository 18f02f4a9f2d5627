"""The block file format: a standard safetensors file, every way a file can be unusable is
detected, and writers racing on one key never expose a partial file."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import kvfit
from kvfit.connectors.block_file import (
    TMP_SUFFIX,
    BlockFileError,
    BlockFormat,
    read_block,
    read_header,
    write_block,
)

FMT = BlockFormat(torch.bfloat16, (2, 16, 2, 8), namespace="ab" * 32)


def block(seed: int, fmt: BlockFormat = FMT) -> torch.Tensor:
    return torch.randn(fmt.shape, generator=torch.Generator().manual_seed(seed)).to(fmt.dtype)


def test_a_block_file_is_safetensors_and_reads_back(tmp_path) -> None:
    path, data = tmp_path / "k.safetensors", block(0)
    write_block(path, FMT, "k", data, {"model": "m"})
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("kv"), data)
        meta = f.metadata()
    assert (meta["namespace"], meta["key"], meta["model"]) == (FMT.namespace, "k", "m")
    out = torch.empty(FMT.shape, dtype=FMT.dtype)
    read_block(path, FMT, "k", out)
    assert torch.equal(out, data)
    assert [p.name for p in tmp_path.iterdir()] == ["k.safetensors"]  # no temporary left


@pytest.mark.parametrize("damage, match", [
    (lambda raw: raw[: len(raw) - 7], "truncated"),
    (lambda raw: raw[:5], "truncated"),
    (lambda raw: b"\xff" * 8 + raw[8:], "not a safetensors file"),
    (lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]), "checksum"),
    (lambda raw: raw + b"\0", "padded"),
])
def test_unusable_files_are_detected(tmp_path, damage, match) -> None:
    path = tmp_path / "k.safetensors"
    write_block(path, FMT, "k", block(0))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(BlockFileError, match=match):
        read_block(path, FMT, "k", torch.empty(FMT.shape, dtype=FMT.dtype))


def test_foreign_files_are_detected_by_their_header(tmp_path) -> None:
    path = tmp_path / "k.safetensors"
    other_model = BlockFormat(FMT.dtype, FMT.shape, namespace="cd" * 32)
    write_block(path, other_model, "k", block(0), {"model": "other", "layout": "x"})
    with pytest.raises(BlockFileError, match=r"another model or KV layout \(other, x\)"):
        read_header(path, FMT, "k")
    write_block(path, FMT, "k2", block(0))
    with pytest.raises(BlockFileError, match="holds block 'k2'"):
        read_header(path, FMT, "k")
    other_shape = BlockFormat(torch.float32, FMT.shape, FMT.namespace)
    with pytest.raises(BlockFileError, match="tensor BF16"):
        read_header(path, other_shape, "k2")


@pytest.mark.parametrize("header", [
    {"__metadata__": "not an object", "kv": {}},
    {"__metadata__": {"format": "kvfit-kv-block-v1"}, "kv": []},
])
def test_a_header_of_the_wrong_shape_is_unusable_not_a_crash(tmp_path, header) -> None:
    raw = json.dumps(header).encode()
    path = tmp_path / "k.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(BlockFileError, match="unreadable header"):
        read_header(path, FMT, "k")


_WRITER = """
import sys, torch
from kvfit.connectors.block_file import BlockFormat, write_block
from pathlib import Path
root, seed, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
fmt = BlockFormat(torch.float32, (4, 64, 1024), namespace="ab" * 32)
data = torch.full(fmt.shape, float(seed))
for r in range(rounds):
    for k in range(4):
        write_block(root / f"k{k}.safetensors", fmt, f"k{k}", data)
"""


def test_concurrent_writers_never_expose_a_partial_file(tmp_path) -> None:
    """Two processes rewrite the same 1 MiB blocks while this one reads them: every read sees
    one writer's whole block."""
    fmt = BlockFormat(torch.float32, (4, 64, 1024), namespace="ab" * 32)
    env = {**os.environ, "PYTHONPATH": str(Path(kvfit.__file__).parents[1])}
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(seed), "10"],
                                env=env) for seed in (1, 2)]
    out = torch.empty(fmt.shape)
    reads = 0
    deadline = time.monotonic() + 120
    while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
        for k in range(4):
            try:
                read_block(tmp_path / f"k{k}.safetensors", fmt, f"k{k}", out)
            except FileNotFoundError:
                continue
            assert out[0, 0, 0].item() in (1.0, 2.0) and bool((out == out[0, 0, 0]).all())
            reads += 1
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    assert reads > 0
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX)]
