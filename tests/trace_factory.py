"""Random but valid RolloutTraces for tests: distinct experts per token-layer, exact sorted support.

Every array is drawn vectorised so thousands of traces cost well under a second; the sampled token
of each generated position is taken from that position's support row (invariant 5: the sampled
token always had non-zero probability).
"""

from __future__ import annotations

import numpy as np

from moe_replay.geometry import EngineInfo, ModelGeometry
from moe_replay.trace import RolloutTrace, SamplingSupport

TINY_GEOMETRY = ModelGeometry(num_layers=4, moe_layer_ids=(1, 3), num_experts=8, top_k=2, vocab_size=512, family="tiny")
"""4 decoder layers (MoE at 1 and 3), 8 experts top-2, vocab 512: small enough for 1M-token tests."""


def random_routes(rng: np.random.Generator, num_rows: int, geometry: ModelGeometry) -> np.ndarray:
    """[T, L, K] distinct expert ids per token-layer, in a random (engine-like) column order."""
    scores = rng.random((num_rows, geometry.num_moe_layers, geometry.num_experts))
    return np.argsort(scores, axis=-1)[..., : geometry.top_k].astype(geometry.route_dtype)


def random_support(rng: np.random.Generator, num_rows: int, vocab_size: int, max_kept: int = 16) -> SamplingSupport:
    """CSR support with 1..max_kept sorted unique ids per row (draws with replacement, then dedups)."""
    want = rng.integers(1, max_kept + 1, size=num_rows)
    rows = np.repeat(np.arange(num_rows, dtype=np.int64), want)
    flat = np.unique(rows * vocab_size + rng.integers(0, vocab_size, size=len(rows)))
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(flat // vocab_size, minlength=num_rows), out=offsets[1:])
    return SamplingSupport(offsets, (flat % vocab_size).astype(np.int32))


def random_trace(
    key: str,
    rng: np.random.Generator,
    *,
    geometry: ModelGeometry | None = None,
    num_tokens: int = 48,
    prompt_len: int | None = None,
    route_start: int = 0,
    with_routes: bool = True,
    with_support: bool = True,
    with_logprobs: bool = True,
    max_kept: int = 16,
) -> RolloutTrace:
    """A valid trace of `num_tokens` tokens (prompt defaults to a quarter of them)."""
    g = geometry or TINY_GEOMETRY
    prompt_len = num_tokens // 4 if prompt_len is None else prompt_len
    if not 0 <= prompt_len <= num_tokens or num_tokens < 1:
        raise ValueError(f"need 1 <= num_tokens and 0 <= prompt_len <= num_tokens, got {num_tokens=}, {prompt_len=}")
    num_gen = num_tokens - prompt_len
    tokens = rng.integers(0, g.vocab_size, size=num_tokens, dtype=np.int64)
    support = None
    if with_support:
        support = random_support(rng, num_gen, g.vocab_size, max_kept)
        sizes = support.sizes_G()
        pick = support.offsets_G1[:-1] + (rng.random(num_gen) * sizes).astype(np.int64)
        tokens[prompt_len:] = support.ids_N[pick]
    trace = RolloutTrace(
        key=key,
        token_ids_S=tokens,
        prompt_len=prompt_len,
        geometry=g,
        routes_TLK=random_routes(rng, max(num_tokens - 1 - route_start, 0), g) if with_routes else None,
        route_start=route_start,
        support=support,
        logprobs_G=-rng.exponential(1.0, size=num_gen).astype(np.float32) if with_logprobs else None,
        engine=EngineInfo(name="test", version="0", dtype="bfloat16"),
        extra={"seed_key": key, "num_gen": num_gen},
    )
    return trace.validate()


def trace_for(index: int, seed: int = 0, **kwargs) -> RolloutTrace:
    """The deterministic trace number `index` of a stream (key f"r{index:07d}"), so another process
    can regenerate exactly what a writer stored and compare."""
    rng = np.random.default_rng([seed, index])
    return random_trace(f"r{index:07d}", rng, num_tokens=int(rng.integers(2, 80)), **kwargs)


def shared_trace_for(index: int, seed: int = 0, group: int = 4, prompt: int = 40, **kwargs) -> RolloutTrace:
    """Trace `index` of a stream of prompt groups: the `group` traces of group index // group share
    their first `prompt` tokens and those positions' routes (n samples of one prompt, one prefill),
    then sample their own completion; keyed f"g{index // group:05d}#{index % group}", regenerable
    in another process like trace_for."""
    g_rng = np.random.default_rng([seed, 1, index // group])
    head = random_trace("head", g_rng, num_tokens=prompt + 1, prompt_len=prompt, with_support=False, with_logprobs=False)
    rng = np.random.default_rng([seed, 2, index])
    t = random_trace(f"g{index // group:05d}#{index % group}", rng, num_tokens=prompt + int(rng.integers(8, 40)),
                     prompt_len=prompt, **kwargs)
    t.token_ids_S[:prompt] = head.token_ids_S[:prompt]
    if t.routes_TLK is not None:
        t.routes_TLK[:prompt] = head.routes_TLK[:prompt]  # rows 0..prompt-1: the prompt's forward
    return t.validate()
