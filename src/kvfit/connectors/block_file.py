"""One stored KV block as a safetensors file: one tensor `kv` (`[num_segments, *block_shape]`
in the cache's dtype) and metadata naming what wrote it and a CRC-32 of the tensor's bytes.

Written to a temporary name in the same directory and renamed into place, so a reader never
sees a partial file, whatever other processes write the same key at the same time. A reader
checks the header first (format, namespace, key, dtype, shape, file size: what a truncated or
foreign file gets wrong) and the checksum once the bytes are read (what a corrupt one does).
"""

from __future__ import annotations

import json
import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

FORMAT = "kvfit-kv-block-v1"
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
"""A file being written: hidden, and never a name a reader opens."""

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float8_e4m3fn: "F8_E4M3"}
_HEADER_LEN = struct.Struct("<Q")
_MAX_HEADER = 1 << 16


class BlockFileError(ValueError):
    """A stored block that cannot be used; the message says why."""


@dataclass(frozen=True)
class BlockFormat:
    """What every block file of one store namespace holds: the tensor's dtype and shape, and
    the namespace (model, layout, dtype, shape) it must name."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    namespace: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def _header(fmt: BlockFormat, key: str, crc: int, extra: dict[str, str]) -> bytes:
    meta = {"format": FORMAT, "namespace": fmt.namespace, "key": key, "crc32": str(crc), **extra}
    header = {"kv": {"dtype": _ST_DTYPES[fmt.dtype], "shape": list(fmt.shape),
                     "data_offsets": [0, fmt.nbytes]},
              "__metadata__": meta}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return _HEADER_LEN.pack(len(raw)) + raw


def write_block(path: Path, fmt: BlockFormat, key: str, data: torch.Tensor,
                extra: dict[str, str] | None = None) -> None:
    """Write `data` (a host tensor of `fmt`'s dtype and shape) as `path`, atomically."""
    if data.dtype != fmt.dtype or tuple(data.shape) != fmt.shape:
        raise ValueError(f"block data {data.dtype} {tuple(data.shape)} does not match the "
                         f"store's {fmt.dtype} {fmt.shape}")
    payload = memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(_header(fmt, key, zlib.crc32(payload), extra or {}))
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_header(path: Path, fmt: BlockFormat, key: str) -> dict[str, str]:
    """The file's metadata; `BlockFileError` if it is not a whole block of `fmt` named `key`
    (`FileNotFoundError` if there is none)."""
    with open(path, "rb") as f:
        return _check_header(f, fmt, key)


def read_block(path: Path, fmt: BlockFormat, key: str, out: torch.Tensor) -> None:
    """Read the block named `key` into `out` (a contiguous host tensor of `fmt.nbytes`),
    checking its header and checksum; `BlockFileError` / `OSError` if it cannot be used.

    Header and data come from one open file: a writer may replace the name in between."""
    buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
    with open(path, "rb") as f:
        meta = _check_header(f, fmt, key)
        if f.readinto(buffer) != fmt.nbytes:
            raise BlockFileError("truncated while reading")
    if str(zlib.crc32(buffer)) != meta.get("crc32"):
        raise BlockFileError("checksum mismatch (corrupt data)")


def _check_header(f: BinaryIO, fmt: BlockFormat, key: str) -> dict[str, str]:
    """Read and check the header of the open file `f`, leaving it at the data."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(_HEADER_LEN.size)
    if len(head) < _HEADER_LEN.size:
        raise BlockFileError(f"truncated: {size} bytes")
    (n,) = _HEADER_LEN.unpack(head)
    if n > _MAX_HEADER or n > size:
        raise BlockFileError(f"not a safetensors file (header of {n} bytes in {size})")
    try:
        header = json.loads(f.read(n))
        meta, tensor = header["__metadata__"], header["kv"]
    except (ValueError, KeyError, TypeError) as e:
        raise BlockFileError(f"unreadable header ({e})") from None
    # Valid JSON of another shape would fail below with AttributeError, which the connector
    # does not catch: one such file would fail every step that looks it up.
    if not (isinstance(meta, dict) and isinstance(tensor, dict)):
        raise BlockFileError("unreadable header (__metadata__ and kv must be JSON objects)")
    if meta.get("format") != FORMAT:
        raise BlockFileError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("namespace") != fmt.namespace:
        raise BlockFileError(f"written for another model or KV layout "
                             f"({meta.get('model', '?')}, {meta.get('layout', '?')})")
    if meta.get("key") != key:
        raise BlockFileError(f"holds block {meta.get('key')!r}, not {key!r}")
    if (tensor.get("dtype"), tensor.get("shape")) != (_ST_DTYPES[fmt.dtype], list(fmt.shape)):
        raise BlockFileError(f"tensor {tensor.get('dtype')} {tensor.get('shape')}, expected "
                             f"{_ST_DTYPES[fmt.dtype]} {list(fmt.shape)}")
    if size != _HEADER_LEN.size + n + fmt.nbytes:
        raise BlockFileError(f"truncated or padded: {size} bytes, expected "
                             f"{_HEADER_LEN.size + n + fmt.nbytes}")
    return meta
