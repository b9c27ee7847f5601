"""Route codecs: expert ids [T, L, K] <-> bytes, top-k column order preserved exactly.

Registered codecs (name -> bytes per token-layer at E experts, top-K):
  int32       4K          what naive systems store
  narrow      K or 2K     uint8 up to 256 experts, else uint16 (the best anyone ships)
  moe_replay  < log2(E!/(E-K)!) / 8 on skewed routing (entropy coded, see below)

The `moe_replay` codec, layer-major (one Huffman table per MoE layer, fitted to that layer's
expert popularity):
  * joint mode, when the ordered K-tuples fit a byte (E!/(E-K)! <= 256, e.g. 8 experts top-2):
    each token-layer becomes its permutation rank (lexicographic over ordered K-permutations),
    so the coder sees the joint distribution of the tuple and never pays for impossible repeats;
  * id mode otherwise: the ids themselves, one byte plane per id byte.
  * enum mode for short records (at most ENUM_MAX_BITS), where Huffman tables do not
    amortise: all token-layers' permutation ranks as one mixed-radix integer, i.e. the bound
    rounded up to a whole byte per record; the encoder keeps whichever of the two is smaller.
The order-preserving bound log2(E!/(E-K)!) is what a uniform coder over valid tuples needs;
routing is skewed, so a per-layer entropy coder goes below it on records of useful length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import permutations
from typing import Any, Protocol

import numpy as np

from ..geometry import route_dtype
from ..registry import Registry
from . import entropy

# Streams shorter than this share one Huffman table across layers: a table costs ~40-100 bytes,
# which would outweigh the gain of per-layer tables on short sequences.
MIN_SYMBOLS_PER_TABLE = 2048
# Enum mode is tried only when Huffman lands above the bound and the whole record's rank fits
# this many bits (Python big-integer division is quadratic: ~1 ms at the limit).
ENUM_MAX_BITS = 1 << 15


def bound_bits_per_token_layer(num_experts: int, top_k: int) -> float:
    """log2(E! / (E-K)!): bits to name an ordered K-tuple of distinct experts, uniformly."""
    return sum(math.log2(num_experts - i) for i in range(top_k))


class RouteCodec(Protocol):
    name: str

    def encode(self, routes_TLK: np.ndarray, num_experts: int) -> tuple[bytes, dict[str, Any]]: ...

    def decode(self, data: bytes, shape_TLK: tuple[int, int, int], num_experts: int, params: dict[str, Any]) -> np.ndarray:
        """Inverse of encode. Raises ValueError on bytes that do not decode to shape_TLK."""
        ...


ROUTE_CODECS: Registry[RouteCodec] = Registry("route codec")


def _expect_len(data: bytes, n: int, what: str) -> None:
    if len(data) != n:
        raise ValueError(f"{what}: expected {n} bytes, found {len(data)}")


@dataclass(frozen=True)
class Int32Codec:
    name: str = "int32"

    def encode(self, routes_TLK, num_experts):
        return np.ascontiguousarray(routes_TLK, dtype="<i4").tobytes(), {}

    def decode(self, data, shape_TLK, num_experts, params):
        _expect_len(data, 4 * math.prod(shape_TLK), "int32 routes")
        return np.frombuffer(data, dtype="<i4").reshape(shape_TLK).astype(route_dtype(num_experts))


@dataclass(frozen=True)
class NarrowCodec:
    name: str = "narrow"

    def encode(self, routes_TLK, num_experts):
        dt = route_dtype(num_experts).newbyteorder("<")
        return np.ascontiguousarray(routes_TLK, dtype=dt).tobytes(), {}

    def decode(self, data, shape_TLK, num_experts, params):
        dt = route_dtype(num_experts).newbyteorder("<")
        _expect_len(data, dt.itemsize * math.prod(shape_TLK), "narrow routes")
        return np.frombuffer(data, dtype=dt).reshape(shape_TLK).astype(route_dtype(num_experts), copy=False)


@lru_cache(maxsize=64)
def _perm_table(num_experts: int, top_k: int) -> np.ndarray:
    """[P, K] every ordered K-permutation of range(E), in lexicographic (= rank) order."""
    return np.array(list(permutations(range(num_experts), top_k)), dtype=route_dtype(num_experts)).reshape(-1, top_k)


def _joint_ok(num_experts: int, top_k: int) -> bool:
    return math.perm(num_experts, top_k) <= 256


def perm_rank(routes_NK: np.ndarray, num_experts: int) -> np.ndarray:
    """Lexicographic rank of each ordered K-tuple of distinct ids (mixed radix E, E-1, ...)."""
    ids = routes_NK.astype(np.int64)
    k_total = ids.shape[1]
    rank = np.zeros(ids.shape[0], dtype=np.int64)
    for k in range(k_total):
        reduced = ids[:, k] - (ids[:, :k] < ids[:, k : k + 1]).sum(axis=1)
        rank = rank * (num_experts - k) + reduced
    return rank


def _digits_to_int(d: list[int], base: int) -> int:
    """sum(d[i] * base**i), by halving so big-integer products stay balanced."""
    pows: dict[int, int] = {}

    def rec(lo: int, hi: int) -> int:
        if hi - lo <= 32:
            v = 0
            for x in reversed(d[lo:hi]):
                v = v * base + x
            return v
        mid = (lo + hi) // 2
        p = pows.setdefault(mid - lo, base ** (mid - lo))
        return rec(lo, mid) + rec(mid, hi) * p

    return rec(0, len(d)) if d else 0


def _int_to_digits(v: int, n: int, base: int) -> list[int]:
    """Inverse of _digits_to_int for exactly n digits."""
    if n <= 32:
        out = []
        for _ in range(n):
            v, r = divmod(v, base)
            out.append(r)
        return out
    h = n // 2
    q, r = divmod(v, base**h)
    return _int_to_digits(r, h, base) + _int_to_digits(q, n - h, base)


def perm_unrank(rank_N: np.ndarray, num_experts: int, top_k: int) -> np.ndarray:
    """Inverse of perm_rank: [N] ranks -> [N, K] ordered tuples of distinct ids."""
    rank = rank_N.astype(np.int64).copy()
    reduced = np.empty((len(rank), top_k), dtype=np.int64)
    for k in range(top_k - 1, -1, -1):
        rank, reduced[:, k] = np.divmod(rank, num_experts - k)
    ids = np.empty_like(reduced)
    for k in range(top_k):
        idk = reduced[:, k].copy()
        for prev in np.sort(ids[:, :k], axis=1).T:  # skip the ids already taken, smallest first
            idk += prev <= idk
        ids[:, k] = idk
    return ids


def _enum_ok(num_experts: int, top_k: int, token_layers: int) -> bool:
    # ranks are computed in int64 (perm_rank), so the tuple count must stay below 2^62
    if math.perm(num_experts, top_k) >= 2**62:
        return False
    return 0 < token_layers and token_layers * bound_bits_per_token_layer(num_experts, top_k) <= ENUM_MAX_BITS


def _enum_encode(routes_NK: np.ndarray, num_experts: int) -> bytes:
    p = math.perm(num_experts, routes_NK.shape[1])
    n = routes_NK.shape[0]
    value = _digits_to_int(perm_rank(routes_NK, num_experts).tolist(), p)
    return value.to_bytes(((p**n - 1).bit_length() + 7) // 8, "little")


def _enum_decode(data: bytes, n: int, num_experts: int, top_k: int) -> np.ndarray:
    p = math.perm(num_experts, top_k)
    want = ((p**n - 1).bit_length() + 7) // 8
    if len(data) != want:
        raise ValueError(f"enum routes: expected {want} bytes, found {len(data)}")
    value = int.from_bytes(data, "little")
    if value >= p**n:
        raise ValueError(f"enum routes: value out of range for {n} token-layers of {p} tuples")
    ranks = np.array(_int_to_digits(value, n, p), dtype=np.int64)
    return perm_unrank(ranks, num_experts, top_k).astype(route_dtype(num_experts))


@dataclass(frozen=True)
class EntropyCodec:
    """Layer-major, per-layer-table Huffman coding of joint ranks or id bytes (see module doc)."""

    name: str = "moe_replay"

    def encode(self, routes_TLK, num_experts):
        t, l, k = routes_TLK.shape
        routes_LTK = np.ascontiguousarray(np.asarray(routes_TLK).transpose(1, 0, 2))
        if _joint_ok(num_experts, k):
            mode = "joint"
            sym_LN = perm_rank(routes_LTK.reshape(-1, k), num_experts).astype(np.uint8).reshape(l, t)
            planes = [sym_LN]
        else:
            mode = "ids"
            dt = route_dtype(num_experts)
            flat = routes_LTK.reshape(l, t * k).astype(dt, copy=False)
            # one byte plane per id byte: low bytes of skewed ids are what carry the entropy
            planes = [flat] if dt.itemsize == 1 else [((flat >> (8 * b)) & 0xFF).astype(np.uint8) for b in range(dt.itemsize)]
        per_layer = planes[0].shape[1] >= MIN_SYMBOLS_PER_TABLE
        streams = [p[i].data for p in planes for i in range(l)] if per_layer else [p.data for p in planes]
        data = entropy.compress(streams, "huffman")
        over_bound = 8 * len(data) > t * l * bound_bits_per_token_layer(num_experts, k)
        if over_bound and _enum_ok(num_experts, k, t * l):
            enum = _enum_encode(routes_LTK.reshape(-1, k), num_experts)
            if len(enum) < len(data):
                return enum, {"mode": "enum"}
        return data, {"mode": mode, "tables": "layer" if per_layer else "shared"}

    def decode(self, data, shape_TLK, num_experts, params):
        t, l, k = shape_TLK
        mode = params.get("mode")
        if mode == "enum":
            if not _enum_ok(num_experts, k, t * l):
                raise ValueError(f"enum route mode: expected at most {ENUM_MAX_BITS} bits of ranks, "
                                 f"found {t * l} token-layers at E={num_experts}, K={k}")
            routes_LTK = _enum_decode(data, t * l, num_experts, k).reshape(l, t, k)
        elif mode == "joint":
            if not _joint_ok(num_experts, k):
                raise ValueError(f"joint route mode needs E!/(E-K)! <= 256, found E={num_experts}, K={k}")
            sym = np.frombuffer(entropy.decompress(data, l * t), dtype=np.uint8)
            table = _perm_table(num_experts, k)
            if sym.size and int(sym.max()) >= len(table):
                raise ValueError(f"joint route rank out of range: expected < {len(table)}, found {int(sym.max())}")
            routes_LTK = table[sym].reshape(l, t, k)
        elif mode == "ids":
            dt = route_dtype(num_experts)
            n = l * t * k
            raw = np.frombuffer(entropy.decompress(data, n * dt.itemsize), dtype=np.uint8)
            if dt.itemsize == 1:
                routes_LTK = raw.reshape(l, t, k)
            else:
                planes = raw.reshape(dt.itemsize, n).astype(dt)
                flat = planes[0].copy()
                for b in range(1, dt.itemsize):
                    flat |= planes[b] << (8 * b)
                routes_LTK = flat.reshape(l, t, k)
        else:
            raise ValueError(f"route codec mode: expected 'joint', 'ids' or 'enum', found {mode!r}")
        return routes_LTK.transpose(1, 0, 2)  # a view: no copy back to token-major


def _layer_planes(routes_LTK: np.ndarray, num_experts: int) -> tuple[str, list[list[np.ndarray]]]:
    """(mode, per layer its symbol planes): the joint ranks, or the id bytes plane by plane."""
    l, t, k = routes_LTK.shape
    if _joint_ok(num_experts, k):
        return "joint", [[p] for p in perm_rank(routes_LTK.reshape(-1, k), num_experts).astype(np.uint8).reshape(l, t)]
    dt = route_dtype(num_experts)
    flat = routes_LTK.reshape(l, t * k).astype(dt, copy=False)
    if dt.itemsize == 1:
        return "ids", [[row] for row in flat]
    return "ids", [[((row >> (8 * b)) & 0xFF).astype(np.uint8) for b in range(dt.itemsize)] for row in flat]


def _symbols_per_layer(rows: int, num_experts: int, top_k: int) -> int:
    """Bytes one layer of `rows` routed positions inflates to under _layer_planes."""
    return rows if _joint_ok(num_experts, top_k) else rows * top_k * route_dtype(num_experts).itemsize


@dataclass(frozen=True)
class LayeredCodec:
    """The `moe_replay` coding (one Huffman table per layer) with every layer byte-addressable.

    One raw deflate stream, layer-major, with a full flush after each layer: the flush byte-aligns
    the stream and resets the coder, so the bytes from `params["offsets"][l]` on inflate alone to
    layers l, l+1, ... A reader of layers [a, b) (a pipeline stage's) reads and inflates only
    offsets[a]..offsets[b]. Cost of the flushes: 4-5 bytes per layer (+0.01 B per token-layer on
    512-row chunks of the Qwen3-30B-A3B-shaped synthetic, 6.94 vs 6.93), and full decodes inflate
    at the same speed as the one-stream codec (one call). Shared-prefix chunks use it
    (store/chunks.py); no enum mode: chunks are long enough for per-layer tables.
    """

    name: str = "moe_replay_layered"

    def encode(self, routes_TLK, num_experts):
        t, l, k = routes_TLK.shape
        mode, planes_L = _layer_planes(np.ascontiguousarray(np.asarray(routes_TLK).transpose(1, 0, 2)), num_experts)
        data = entropy.compress_layers(planes_L)
        return data.data, {"mode": mode, "offsets": data.offsets}

    def decode(self, data, shape_TLK, num_experts, params):
        t, l, k = shape_TLK
        return self.decode_layers(data, shape_TLK, num_experts, params, 0, l)

    def layer_span(self, params: dict[str, Any], first: int, stop: int, num_layers: int) -> tuple[int, int]:
        """The byte range [start, end) of the payload holding layers [first, stop)."""
        offsets = params.get("offsets")
        if (not isinstance(offsets, list) or len(offsets) != num_layers + 1
                or any(not isinstance(o, int) or isinstance(o, bool) for o in offsets)
                or any(b < a for a, b in zip(offsets, offsets[1:])) or offsets[0] != 0):
            raise ValueError(f"layered routes: expected {num_layers + 1} non-decreasing layer offsets from 0, "
                             f"found {offsets!r:.80}")
        if not 0 <= first < stop <= num_layers:
            raise ValueError(f"layered routes: expected a layer range inside [0, {num_layers}), found [{first}, {stop})")
        return offsets[first], offsets[stop]

    def decode_layers(self, part, shape_TLK, num_experts, params, first: int, stop: int) -> np.ndarray:
        """Routes [T, stop - first, K] of layers [first, stop) from `part`, the payload bytes
        layer_span(params, first, stop) names (the whole payload for every layer)."""
        t, l, k = shape_TLK
        start, end = self.layer_span(params, first, stop, l)
        _expect_len(part, end - start, f"layered routes of layers [{first}, {stop})")
        n = stop - first
        mode = params.get("mode")
        per_layer = _symbols_per_layer(t, num_experts, k)
        raw = entropy.decompress(part, n * per_layer, final=stop == l)
        if mode == "joint":
            if not _joint_ok(num_experts, k):
                raise ValueError(f"joint route mode needs E!/(E-K)! <= 256, found E={num_experts}, K={k}")
            sym = np.frombuffer(raw, dtype=np.uint8)
            table = _perm_table(num_experts, k)
            if sym.size and int(sym.max()) >= len(table):
                raise ValueError(f"joint route rank out of range: expected < {len(table)}, found {int(sym.max())}")
            routes_LTK = table[sym].reshape(n, t, k)
        elif mode == "ids":
            if _joint_ok(num_experts, k):
                raise ValueError(f"ids route mode at E={num_experts}, K={k}: expected joint (the tuples fit a byte)")
            dt = route_dtype(num_experts)
            if dt.itemsize == 1:
                routes_LTK = np.frombuffer(raw, dtype=np.uint8).reshape(n, t, k)
            else:
                planes = np.frombuffer(raw, dtype=np.uint8).reshape(n, dt.itemsize, t * k).astype(dt)
                flat = planes[:, 0].copy()
                for b in range(1, dt.itemsize):
                    flat |= planes[:, b] << (8 * b)
                routes_LTK = flat.reshape(n, t, k)
        else:
            raise ValueError(f"layered route mode: expected 'joint' or 'ids', found {mode!r}")
        return routes_LTK.transpose(1, 0, 2)


for _codec in (Int32Codec(), NarrowCodec(), EntropyCodec(), LayeredCodec()):
    ROUTE_CODECS.add(_codec.name, _codec)
