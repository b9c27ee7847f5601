"""Entropy stage: raw deflate from the standard library's zlib, used as a fast Huffman coder.

Why zlib: the speed targets (tens of millions of expert ids per second per core) need a native
coder, the core may import only torch/numpy/msgpack, and zlib ships with Python. With
`Z_HUFFMAN_ONLY` deflate is a plain per-block Huffman coder (no match search), so encode and
decode run at hundreds of MB/s. A block flush between streams starts a new block, and with it a
fresh Huffman table fitted to that stream (e.g. one MoE layer's expert popularity).
"""

from __future__ import annotations

import zlib
from typing import Iterable, Literal, NamedTuple, Sequence

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


class LayeredStream(NamedTuple):
    data: bytes
    offsets: list[int]
    """Byte offset where each layer's bytes start, then the stream's length (L + 1 values)."""


def compress_layers(planes_L: Sequence[Sequence[bytes | memoryview | object]]) -> LayeredStream:
    """Deflate layer after layer (each layer's planes split by block flushes, each with its own
    table), with a full flush after every layer but the last: the stream from any layer's offset
    inflates on its own (the flush byte-aligns and forgets the history; Huffman-only coding has
    none to forget anyway)."""
    co = zlib.compressobj(1, zlib.DEFLATED, _WBITS, 9, zlib.Z_HUFFMAN_ONLY)
    parts: list[bytes] = []
    offsets, size = [0], 0
    for i, planes in enumerate(planes_L):
        for j, plane in enumerate(planes):
            if j:
                parts.append(co.flush(zlib.Z_BLOCK))
            parts.append(co.compress(memoryview(plane).cast("B")))
        parts.append(co.flush(zlib.Z_FULL_FLUSH if i < len(planes_L) - 1 else zlib.Z_FINISH))
        size = sum(len(p) for p in parts)
        offsets.append(size)
    if not planes_L:
        parts.append(co.flush(zlib.Z_FINISH))
    return LayeredStream(b"".join(parts), offsets)


def decompress(data: bytes, expected_len: int, final: bool = True) -> bytes:
    """Inflate and insist on exactly `expected_len` bytes and a complete stream (ValueError otherwise).
    `final=False`: the bytes stop at a full-flush point inside a stream (compress_layers), so they
    must all be consumed without reaching its end."""
    do = zlib.decompressobj(_WBITS)
    try:
        out = do.decompress(data, expected_len + 1)
    except zlib.error as e:
        raise ValueError(f"deflate stream is corrupt: {e}") from None
    if len(out) != expected_len or do.eof != final or do.unused_data or do.unconsumed_tail:
        end = "a clean end" if final else "a flush point (not the stream's end)"
        raise ValueError(
            f"deflate stream: expected {expected_len} bytes and {end}, found {len(out)} bytes, "
            f"eof={do.eof}, {len(do.unused_data) + len(do.unconsumed_tail)} trailing bytes"
        )
    return out
