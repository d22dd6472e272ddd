"""Reader for the IDX format MNIST is published in (http://yann.lecun.com/exdb/mnist/).

An IDX file is: two zero bytes, a type code (0x08 = unsigned byte), the number of dimensions,
then one big-endian uint32 per dimension, then the data. Files may be gzip-compressed.
"""
from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

UBYTE = 0x08


class DataError(ValueError):
    """A data file is missing, corrupt, truncated or inconsistent. The message names the file."""


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as err:
        raise DataError(f"{path}: corrupt or truncated gzip stream ({err})") from err


def read_idx(path: str | Path, expected_ndim: int) -> np.ndarray:
    """Return the array stored in an IDX file (uint8), checking magic, shape and length."""
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise DataError(f"{path}: too short to be an IDX file ({len(data)} bytes)")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != UBYTE or ndim != expected_ndim:
        raise DataError(
            f"{path}: wrong magic number 0x{data[:4].hex()} "
            f"(expected 0x000008{expected_ndim:02x}: unsigned bytes, {expected_ndim} dimensions)"
        )
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DataError(f"{path}: truncated header")
    shape = struct.unpack(f">{ndim}I", data[4:header_len])
    expected = int(np.prod(shape))
    found = len(data) - header_len
    if found != expected:
        kind = "truncated" if found < expected else "has trailing bytes"
        raise DataError(f"{path}: {kind}: header says shape {shape} = {expected} bytes, found {found}")
    return np.frombuffer(data, dtype=np.uint8, offset=header_len).reshape(shape)


def write_idx(path: str | Path, array: np.ndarray, compress: bool = True) -> None:
    """Write a uint8 array as IDX (used by tests and tools that make small MNIST-format files)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, UBYTE, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.tobytes()
    Path(path).write_bytes(gzip.compress(payload) if compress else payload)
