"""Shared route chunks: which runs of a record's routes a store keeps once, and under what key.

Records that share a prefix (the n samples of a prompt, the turns of an agentic rollout, each
re-sending its growing context, a stitched conversation and its turns) hold the same routes for
it. A store keeps such runs of rows as chunks (codec/chunk.py), each stored once; a record names
its chunks and holds only its other rows (schema v4 `route_chunks`), and reading it reassembles
the very trace that was written (`RolloutTrace.equals`).

The key of a chunk of route rows [c, e) (positions; row p is the forward of token p) is made of:
  * c and e;
  * a hash chain over the token ids 0..e-1 (the tokens rows c..e-1 attend to), seeded with the
    model's identity: geometry (family included), weights_version and engine (name, version,
    dtype, noise): what makes it the same computation, as vLLM's prefix-block hashes do;
  * a digest of the routes themselves.
So routes that differ between samples of one prefix (no prefix cache, batch-variant numerics)
get other keys and are never merged by assumption. A writer that finds a stored chunk damaged
never names it again: it writes the rows as a copy, keyed as above plus `:n` (`ChunkKey.copy`). Digests are 128-bit BLAKE2b (stdlib
hashlib): two different runs share a key with probability ~2^-128, per pair.

Where a record is cut. Not into fixed-size blocks: a block left partly filled at a record's end
would be stored inline per record, and runs are found by their exact (c, e). A record's own cut
points are where its sharing can start or end: route_start, its end S - 1, and each generated
span's start a (the prompt, or a turn's context, ends there: the n samples of a prompt diverge
at a) and its last route row b - 1 (the next turn's record extends the context from there). The
writer walks the record from route_start: at each cut point, and at each position where a known
chunk starts, it takes the longest known chunk that matches (tokens and routes); rows no chunk
matches are cut at the cut points inside them, and each piece of at least `min_rows` rows becomes a
new chunk (a shorter one stays in the record, inline). What a
chunk costs besides its routes: ~150 bytes of frame and meta, an index entry of ~150 bytes, and
~110 bytes in each record naming it; min_rows keeps that under ~1% (store options: chunk_min_bytes).

Legend: S tokens, T route rows (S - 1 - route_start), L MoE layers, K top-k.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import msgpack
import numpy as np

from ..codec.chunk import ChunkMeta, ChunkShape, check_shape, decode_chunk, encode_chunk, is_chunk
from ..codec.record import decode_trace, encode_trace, peek_key, record_chunks
from ..codec.routes import bound_bits_per_token_layer
from ..errors import TraceFormatError, Where
from ..trace import RolloutTrace

CHUNK_KEY_PREFIX = "\x00"
"""Index keys of chunks start with it; a record key may not (refused at put in a store with chunks)."""
DIGEST_BYTES = 16
DEFAULT_CHUNK_MIN_BYTES = 64 << 10
"""A run becomes a chunk when its routes would take at least this many bytes at the
order-preserving bound (Qwen3-30B-A3B geometry: 196 rows; the tiny 2-layer, 8-expert models:
~45k rows, so their short records stay whole). ~0.6% of overhead per chunk (~400 bytes) at
the threshold; a chunk's Huffman tables (~60 bytes a layer) ~5% at 196 rows, less above."""
WIRE_CHUNK_MIN_BYTES = 4 << 10
"""The threshold where a batch crosses a wire (the Ray pool's shipments, verl's DataProto): a chunk
there costs no index entry, only its head and meta (~0.8 KB at 48 layers) and its tables, and a
prompt shared by n samples saves n - 1 copies of its routes: at Qwen3-30B-A3B geometry 4 KiB is 12
rows, so a 150-token GRPO prompt (50 KB of routes) is sent once instead of n times."""


def is_chunk_key(key: str) -> bool:
    return key.startswith(CHUNK_KEY_PREFIX)


class ChunkKey(NamedTuple):
    """The parts of a chunk key (parse_key(key) gives them back from the index key alone)."""

    start: int
    end: int
    tokens: str
    """Hex digest of the hash chain over identity and tokens 0..end-1."""
    routes: str
    """Hex digest of the routes of rows start..end-1."""
    copy: int = 0
    """0 for the first chunk of these rows; n > 0 for the n-th copy a writer wrote because the
    earlier ones were damaged (a damaged chunk is never reused: `ChunkTable.usable`). The key of a
    copy has a fifth part, `:n`; a reader finds every chunk by its whole key, so older readers
    read copies too."""

    def key(self) -> str:
        copy = f":{self.copy}" if self.copy else ""
        return f"{CHUNK_KEY_PREFIX}{self.start}:{self.end}:{self.tokens}:{self.routes}{copy}"

    def label(self) -> str:
        """How errors and reports name the chunk (the key without its control character)."""
        return f"chunk {self.start}..{self.end}:{self.routes[:12]}" + (f"/{self.copy}" if self.copy else "")


def parse_key(key: str) -> ChunkKey | None:
    """The parts of a chunk key, or None for a key that is not one."""
    if not is_chunk_key(key):
        return None
    parts = key[len(CHUNK_KEY_PREFIX):].split(":")
    if len(parts) not in (4, 5) or not all(p.isdigit() for p in (parts[0], parts[1], *parts[4:])):
        return None
    copy = int(parts[4]) if len(parts) == 5 else 0
    if len(parts) == 5 and (copy < 1 or parts[4] != str(copy)):
        return None  # one spelling per key: copy 0 has four parts
    return ChunkKey(int(parts[0]), int(parts[1]), parts[2], parts[3], copy)


def label(key: str) -> str:
    parsed = parse_key(key)
    return parsed.label() if parsed is not None else repr(key)


class ChunkMissingError(TraceFormatError):
    """A record names a route chunk its store does not hold (lost with a damaged segment, or a
    store copied without it)."""


def frame_key(payload: bytes | memoryview, where: Where) -> str:
    """The key of a checksummed frame, record or chunk, after the checks its bytes alone allow: a
    chunk decodes whole; a record decodes whole when it holds all its rows, else its envelope and
    chunk list are checked (its chunks are checked when it is read). Typed errors otherwise."""
    if is_chunk(payload):
        meta, _, _ = decode_chunk(payload, where)
        if not is_chunk_key(meta.key):
            raise TraceFormatError(where.with_(field="chunk.key"), f"a key starting {CHUNK_KEY_PREFIX!r}", repr(meta.key[:40]))
        return meta.key
    data = bytes(payload)
    if record_chunks(data, where):
        return peek_key(data, where)
    return decode_trace(data, where).key


def check_meta(meta: ChunkMeta, key: str, want: ChunkShape, where: Where) -> None:
    """Refuse a chunk that is not the one asked for: another key, rows or geometry."""
    if meta.key != key:
        raise TraceFormatError(where.with_(field="chunk.key"), label(key), label(meta.key), "the frame holds another chunk")
    check_shape(meta, want, where)


def decode_whole(payload: bytes | memoryview, key: str, want: ChunkShape, first: int, stop: int, where: Where,
                 checked: bool) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, routes of layers [first, stop)) of a whole chunk payload, checked to be chunk `key`
    of that shape; `checked`: a CRC over the whole payload held already (a store frame's)."""
    meta, tokens_T, routes = decode_chunk(payload, where, first, stop, checked)
    check_meta(meta, key, want, where)
    return tokens_T, routes


def read_held(payloads, key: str, want: ChunkShape, first: int, stop: int, record_where: Where, absent: str):
    """(tokens, routes of layers [first, stop)) of chunk `key` from `payloads` (key -> payload, held
    in memory: a MemoryStore's, a Ray actor's), each part CRC-checked; ChunkMissingError naming the
    chunk and the record when it is not held (`absent` says where it was looked for)."""
    payload = payloads.get(key)
    where = record_where.with_(field=label(key))
    if payload is None:
        raise ChunkMissingError(where, "the route chunk the record names", absent)
    return decode_whole(payload, key, want, first, stop, where, checked=False)


def identity_digest(trace: RolloutTrace) -> bytes:
    """What makes two records the same computation, besides their tokens: model geometry,
    weights_version and engine (its free-form extra included)."""
    ident = {"geometry": trace.geometry.to_dict(), "weights_version": trace.weights_version, "engine": trace.engine.to_dict()}
    return hashlib.blake2b(msgpack.packb(ident, use_bin_type=True), digest_size=DIGEST_BYTES).digest()


class TokenChain:
    """Hashes of identity + token ids 0..e-1 for any e, from one running BLAKE2b (int64 LE ids)."""

    def __init__(self, trace: RolloutTrace) -> None:
        self._tokens = np.ascontiguousarray(trace.token_ids_S, dtype="<i8")
        self._seed = hashlib.blake2b(identity_digest(trace), digest_size=DIGEST_BYTES)
        self._done: dict[int, str] = {}

    def at(self, ends: list[int]) -> list[str]:
        """The hex digests at each of `ends` (any order), hashing the tokens once up to the largest."""
        todo = sorted(set(e for e in ends if e not in self._done))
        h, pos = self._seed.copy(), 0
        for e in todo:
            h.update(memoryview(self._tokens[pos:e]).cast("B"))
            pos = e
            self._done[e] = h.copy().hexdigest()
        return [self._done[e] for e in ends]


def routes_digest(routes_TLK: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(np.asarray(routes_TLK.shape, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(routes_TLK).data)
    return h.hexdigest()


@dataclass
class ChunkTable:
    """A writer's lookup of the chunks its store holds, built from their keys alone.

    `usable(key)`: whether a record may name that chunk (None: every chunk may). A directory
    writer checks there, once per chunk per writer session, that the chunk's frame is intact
    (DirectoryStore.check_chunk); a damaged chunk is never named again: the rows it held become
    a new copy (`ChunkKey.copy`), written with the record."""

    keys: set[str] = field(default_factory=set)
    usable: Callable[[str], bool] | None = None
    _ends: dict[int, list[int]] = field(default_factory=dict)
    """start -> sorted distinct ends of chunks starting there."""
    _by_tokens: dict[tuple[int, int, str], dict[str, list[int]]] = field(default_factory=dict)
    """(start, end, token digest) -> routes digest -> copies stored, ascending."""
    _starts: list[int] = field(default_factory=list)
    """Sorted distinct starts."""

    def add(self, key: str) -> None:
        parsed = parse_key(key)
        if parsed is None or key in self.keys:
            return
        self.keys.add(key)
        ends = self._ends.get(parsed.start)
        if ends is None:
            self._ends[parsed.start] = ends = []
            bisect.insort(self._starts, parsed.start)
        i = bisect.bisect_left(ends, parsed.end)
        if i == len(ends) or ends[i] != parsed.end:
            ends.insert(i, parsed.end)
        copies = self._by_tokens.setdefault((parsed.start, parsed.end, parsed.tokens), {}).setdefault(parsed.routes, [])
        bisect.insort(copies, parsed.copy)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def next_start(self, after: int) -> int | None:
        i = bisect.bisect_right(self._starts, after)
        return self._starts[i] if i < len(self._starts) else None

    def find(self, rows: ChunkKey) -> ChunkKey | None:
        """The newest copy of the chunk holding `rows` that a record may name, or None."""
        copies = self._by_tokens.get(rows[:3], {}).get(rows.routes, ())
        for copy in reversed(copies):
            hit = rows._replace(copy=copy)
            if self.usable is None or self.usable(hit.key()):
                return hit
        return None

    def new_copy(self, rows: ChunkKey) -> ChunkKey:
        """The key of a new chunk holding `rows`: copy 0, or one past the last stored copy (all
        of them unusable: a writer asks only when `find` found none)."""
        copies = self._by_tokens.get(rows[:3], {}).get(rows.routes)
        return rows._replace(copy=copies[-1] + 1 if copies else 0)

    def longest(self, start: int, limit: int, chain: TokenChain, rows_digest) -> ChunkKey | None:
        """The longest known usable chunk [start, e), e <= limit, whose tokens and routes match."""
        ends = [e for e in self._ends.get(start, ()) if e <= limit]
        if not ends:
            return None
        for e, tok in sorted(zip(ends, chain.at(ends)), reverse=True):
            known = self._by_tokens.get((start, e, tok))
            if known:
                dig = rows_digest(start, e)
                if dig in known:
                    hit = self.find(ChunkKey(start, e, tok, dig))
                    if hit is not None:
                        return hit
        return None


class Piece(NamedTuple):
    """Route rows [start, end) of a record (row indices of its routes_TLK) kept in chunk `key`."""

    start: int
    end: int
    key: str


@dataclass
class Split:
    """How one record is stored: the chunks it refers to, and the new chunks to write first."""

    pieces: list[Piece] = field(default_factory=list)
    new: list[tuple[str, bytes]] = field(default_factory=list)
    """(key, chunk payload) of the chunks this record adds, in row order."""
    shared_rows: int = 0
    """Rows found in chunks the store held already."""


def min_rows(trace: RolloutTrace, min_bytes: int) -> int:
    """Rows a run needs to become a chunk: min_bytes of routes at the order-preserving bound."""
    g = trace.geometry
    per_row = g.num_moe_layers * bound_bits_per_token_layer(g.num_experts, g.top_k) / 8
    return max(1, math.ceil(min_bytes / per_row))


def cut_points(trace: RolloutTrace) -> list[int]:
    """Positions where a record's sharing may start or end (see the module doc), sorted."""
    r, end = trace.route_start, trace.num_tokens - 1
    cuts = {r, end}
    for a, b in trace.spans:
        cuts.update((a, b - 1))
    return sorted(c for c in cuts if r <= c <= end)


def split_trace(trace: RolloutTrace, table: ChunkTable, min_bytes: int) -> Split:
    """The chunks `trace`'s routes go to: known ones it matches, new ones for the rest (added to
    `table`, so later records of one batch share them too). A trace without routes, or with
    fewer than min_rows of them, keeps them all inline (an empty Split)."""
    split = Split()
    routes_TLK = trace.routes_TLK
    if routes_TLK is None or trace.num_route_rows == 0:
        return split
    r, end = trace.route_start, trace.num_tokens - 1
    least = min_rows(trace, min_bytes)
    if end - r < least and not len(table):
        return split  # nothing to find, and too short to share
    chain = TokenChain(trace)
    digests: dict[tuple[int, int], str] = {}

    def rows_digest(a: int, b: int) -> str:
        if (a, b) not in digests:
            digests[(a, b)] = routes_digest(routes_TLK[a - r:b - r])
        return digests[(a, b)]

    cuts = cut_points(trace)
    pos, run = r, None
    while pos < end:
        hit = table.longest(pos, end, chain, rows_digest)
        if hit is not None:
            if run is not None:
                _new_run(trace, run, pos, cuts, least, table, chain, rows_digest, split)
                run = None
            split.pieces.append(Piece(hit.start - r, hit.end - r, hit.key()))
            split.shared_rows += hit.end - hit.start
            pos = hit.end
            continue
        if run is None:
            run = pos
        nxt_cut = cuts[bisect.bisect_right(cuts, pos)] if pos < cuts[-1] else end
        nxt_start = table.next_start(pos)
        pos = min(nxt_cut, nxt_start) if nxt_start is not None and nxt_start < end else nxt_cut
    if run is not None:
        _new_run(trace, run, end, cuts, least, table, chain, rows_digest, split)
    return split


def encode_shared(trace: RolloutTrace, table: ChunkTable, min_bytes: int) -> tuple[bytes, Split]:
    """`trace` (validated first) as a record naming the chunks it shares (split_trace against
    `table`: the new ones are added to it and returned in split.new, to be kept before the record,
    or alongside it)."""
    trace.validate()
    split = split_trace(trace, table, min_bytes)
    return encode_trace(trace, validate=False, chunks=[tuple(p) for p in split.pieces]), split


def _new_run(trace: RolloutTrace, a: int, b: int, cuts: list[int], least: int, table: ChunkTable, chain: TokenChain,
             rows_digest, split: Split) -> None:
    """Rows [a, b) no known chunk holds, cut at the cut points inside: each piece of >= `least`
    rows is a new chunk, a shorter one stays inline (a later record extending it still finds the
    chunks after it: the walk looks at every known chunk start)."""
    bounds = [a, *(c for c in cuts if a < c < b), b]
    pieces = [(s, e) for s, e in zip(bounds, bounds[1:]) if e - s >= least]
    r = trace.route_start
    tokens = chain.at([e for _, e in pieces])
    for (s, e), tok in zip(pieces, tokens):
        rows = ChunkKey(s, e, tok, rows_digest(s, e))
        hit = table.find(rows)  # one run may repeat a chunk the same batch wrote (rare: an equal (s, e))
        if hit is None:  # none stored, or every stored copy damaged: a new one
            key = table.new_copy(rows).key()
            split.new.append((key, encode_chunk(key, trace.token_ids_S[s:e], trace.token_dtype, trace.routes_TLK[s - r:e - r],
                                                trace.geometry.num_experts)))
            table.add(key)
        else:
            key = hit.key()
        split.pieces.append(Piece(s - r, e - r, key))
