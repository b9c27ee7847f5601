"""Vectorised LEB128 varints (7 bits per byte, high bit = more bytes follow) over numpy arrays."""

from __future__ import annotations

import numpy as np

MAX_VARINT_BYTES = 10  # enough for any uint64


def encode(values: np.ndarray) -> bytes:
    """Encode non-negative integers; one loop step per byte position, never per value."""
    v = np.asarray(values)
    if v.size == 0:
        return b""
    if v.dtype.kind == "i" and v.min() < 0:
        raise ValueError(f"varint.encode: expected non-negative integers, found min {int(v.min())}")
    v = v.astype(np.uint64, copy=False).ravel()
    nbytes = np.ones(v.shape, dtype=np.int64)
    for j in range(1, MAX_VARINT_BYTES):
        more = v >= np.uint64(1 << (7 * j))
        if not more.any():
            break
        nbytes += more
    starts = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    for j in range(int(nbytes.max())):
        sel = np.flatnonzero(nbytes > j) if j else slice(None)
        chunk = ((v[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        chunk |= np.where(nbytes[sel] > j + 1, 0x80, 0).astype(np.uint8)
        out[starts[sel] + j] = chunk
    return out.tobytes()


def decode(data: bytes | np.ndarray, count: int | None = None) -> np.ndarray:
    """Decode a whole buffer of varints into uint64; `count`, if given, must match.

    Raises ValueError for a varint cut short at the end, one longer than 10 bytes, or a count
    mismatch, so corrupt input never decodes silently into garbage of the wrong length.
    """
    b = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if b.size == 0:
        if count not in (None, 0):
            raise ValueError(f"varint.decode: expected {count} values, found 0")
        return np.zeros(0, dtype=np.uint64)
    if b[-1] & 0x80:
        raise ValueError("varint.decode: buffer ends inside a varint (truncated)")
    ends = np.flatnonzero((b & 0x80) == 0)
    if count is not None and len(ends) != count:
        raise ValueError(f"varint.decode: expected {count} values, found {len(ends)}")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    nbytes = ends - starts + 1
    if nbytes.max() > MAX_VARINT_BYTES:
        raise ValueError(f"varint.decode: varint of {int(nbytes.max())} bytes exceeds {MAX_VARINT_BYTES}")
    payload = (b & 0x7F).astype(np.uint64)
    out = payload[starts].copy()
    for j in range(1, int(nbytes.max())):
        sel = np.flatnonzero(nbytes > j)
        out[sel] |= payload[starts[sel] + j] << np.uint64(7 * j)
    return out
