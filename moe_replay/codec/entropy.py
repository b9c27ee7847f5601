"""Entropy stage: raw deflate from the standard library's zlib, used as a fast Huffman coder.

Why zlib: the speed targets (tens of millions of expert ids per second per core) need a native
coder, the core may import only torch/numpy/msgpack, and zlib ships with Python. With
`Z_HUFFMAN_ONLY` deflate is a plain per-block Huffman coder (no match search), so encode and
decode run at hundreds of MB/s. A block flush between streams starts a new block, and with it a
fresh Huffman table fitted to that stream (e.g. one MoE layer's expert popularity).
"""

from __future__ import annotations

import zlib
from typing import Iterable, Literal

Strategy = Literal["huffman", "default"]
_STRATEGY = {"huffman": zlib.Z_HUFFMAN_ONLY, "default": zlib.Z_DEFAULT_STRATEGY}
_WBITS = -15  # raw deflate: no zlib header or adler32 (the record has its own checksum)


def compress(streams: Iterable[bytes | memoryview], strategy: Strategy = "huffman", level: int = 1) -> bytes:
    """Deflate the streams back to back, with a block boundary between consecutive streams."""
    co = zlib.compressobj(level, zlib.DEFLATED, _WBITS, 9, _STRATEGY[strategy])
    parts = []
    for i, s in enumerate(streams):
        if i:
            parts.append(co.flush(zlib.Z_BLOCK))
        parts.append(co.compress(s))
    parts.append(co.flush(zlib.Z_FINISH))
    return b"".join(parts)


def decompress(data: bytes, expected_len: int) -> bytes:
    """Inflate and insist on exactly `expected_len` bytes and a complete stream (ValueError otherwise)."""
    do = zlib.decompressobj(_WBITS)
    try:
        out = do.decompress(data, expected_len + 1)
    except zlib.error as e:
        raise ValueError(f"deflate stream is corrupt: {e}") from None
    if len(out) != expected_len or not do.eof or do.unused_data:
        raise ValueError(
            f"deflate stream: expected {expected_len} bytes and a clean end, found {len(out)} bytes, "
            f"eof={do.eof}, {len(do.unused_data)} trailing bytes"
        )
    return out
