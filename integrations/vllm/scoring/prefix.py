"""Prompt-KV reuse for re-scoring: replicas read the prompt's KV from vLLM's prefix cache.

A scoring request is the trace's whole sequence submitted as a prompt. vLLM's block hashes chain
over tokens, with the request's `cache_salt` mixed into the first block only, so a replica that
shares a salt with an earlier one shares *every* full block of the sequence, the response's
included: it would skip forwarding response tokens and nothing would be left to score. Two
pieces make only the prompt shareable:

  write cap   the scheduler caches (hashes into the prefix cache) a scoring request's blocks only
              up to `sampling_params.extra_args["moe_replay_cache_upto"]` tokens: the prompt
              minus its last token for reuse, 0 for full re-scoring. Response KV of a replica is
              never cached, so a later replica's lookup can hit the prompt and nothing more.
              Installed by `ScoringScheduler` (SchedulerConfig.scheduler_cls, vLLM's own
              extension point, so it lives wherever the engine core lives: in this process or
              in the engine-core process of AsyncLLM);
  salt        `cache_salt(...)` keys the chain by the routes the prompt was forwarded under, the
              routing mode (forced / free) and the weights version. A rollout (no salt, or its
              own) never reads KV computed under forced routes, and scoring never reads a
              rollout's blocks (whose response KV would be hit too); a weight update changes the
              salt, and `weights.update_weights` also resets the prefix cache.

Scoring on the engine that sampled (`VllmScorerConfig(read_rollout_kv=True)`) reads the rollout's
own prompt blocks instead: the rollout forwarded its prompt under exactly the routes its trace
recorded, so that KV is what a forced replica would compute. Such a request carries no salt (the
rollout's blocks have none), a read cap (`extra_args["moe_replay_read_upto"]`: the prompt minus
its last token, so the rollout's response blocks, which hash the same tokens, are never hit and
every generated token is forwarded and scored) and a write cap of 0: nothing it computes under
forced routes is keyed where a free request could read it. A weight update resets the prefix
cache, so a later replica misses and fails naming its rollout instead of reading old-weights KV.

Hits are whole blocks, so a replica reuses floor((P - 1) / block_size) * block_size prompt
tokens and forwards the rest: the prompt's tail and every generated token (the row at P - 1
gives the first generated token's logits and is always forwarded).
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import numpy as np

from ....trace import RolloutTrace

CACHE_UPTO_KEY = "moe_replay_cache_upto"
"""SamplingParams.extra_args key: tokens of this request the scheduler may cache (write cap)."""
READ_UPTO_KEY = "moe_replay_read_upto"
"""SamplingParams.extra_args key: tokens of this request the prefix-cache lookup may hit (read cap)."""
SCHEDULER_QUALNAME = f"{__name__}.ScoringScheduler"


def cache_upto(request: Any) -> int | None:
    """The write cap of a scheduler-side request (None: not a scoring request, no cap)."""
    sp = getattr(request, "sampling_params", None)
    extra = getattr(sp, "extra_args", None)
    return None if not extra or CACHE_UPTO_KEY not in extra else int(extra[CACHE_UPTO_KEY])


def read_upto(request: Any) -> int | None:
    """The read cap of a scheduler-side request (None: no cap beyond vLLM's own)."""
    sp = getattr(request, "sampling_params", None)
    extra = getattr(sp, "extra_args", None)
    return None if not extra or READ_UPTO_KEY not in extra else int(extra[READ_UPTO_KEY])


_UNDO: "weakref.WeakKeyDictionary[Any, tuple[Any, Any]]" = weakref.WeakKeyDictionary()
"""Scheduler -> the undo handles of its two patches (patch.py), kept beside it rather than on it."""


class ScoringScheduler:
    """`scheduler_cls` of a scoring engine: vLLM's own scheduler (sync or async, as configured)
    with the write cap on its KV-cache coordinator and the read cap on its prefix-cache lookup.
    `__new__` returns the vLLM scheduler itself."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.core.sched.scheduler import Scheduler

        from ..patch import patch_cache_reads, patch_cache_writes

        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        base = Scheduler
        if getattr(vllm_config.scheduler_config, "async_scheduling", False):
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            base = AsyncScheduler
        sched = base(*args, **kwargs)
        _UNDO[sched] = (patch_cache_writes(sched.kv_cache_manager.coordinator, cache_upto),
                        patch_cache_reads(sched.kv_cache_manager, read_upto))
        return sched


def engine_reuse_ready(vllm_config: Any) -> str | None:
    """None if an engine with this config can reuse prompt KV for scoring, else why not."""
    if not getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        return "the engine was built with enable_prefix_caching=False"
    cls = vllm_config.scheduler_config.scheduler_cls
    name = cls if isinstance(cls, str) else f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', cls)}"
    if name != SCHEDULER_QUALNAME:
        return (f"its scheduler_cls is {name!r}, not {SCHEDULER_QUALNAME!r} (without the write cap, replicas would "
                "share each other's response blocks); build it with scoring_engine_kwargs(prompt_reuse=True)")
    return None


def cache_salt(trace: RolloutTrace, forced: bool, weights_version: str) -> str:
    """Prefix-cache salt of a trace's prompt KV: same tokens + same routes + same weights => same KV.

    Routes of prompt positions [route_start, P - 1) (the only positions whose KV can be cached)
    enter the hash when forced; free routing is keyed by the mode alone (the engine routes it).
    """
    h = hashlib.sha256()
    h.update(f"moe_replay/score/v1|{'forced' if forced else 'free'}|w={weights_version}|".encode())
    if forced and trace.routes_TLK is not None:
        n = max(0, trace.prompt_len - 1 - trace.route_start)
        h.update(f"rs={trace.route_start}|".encode())
        h.update(np.ascontiguousarray(trace.routes_TLK[:n], dtype=np.int64).tobytes())
    return h.hexdigest()[:32]


def prompt_key(trace: RolloutTrace, salt: str) -> str:
    """The prompt blocks a replica of `trace` under `salt` reads: the salt and the prompt's tokens.

    The salt alone does not name them: under free routing it is keyed by the mode only, so every
    trace shares it, and a promise keyed by it would promise one trace the blocks of another."""
    h = hashlib.sha256(salt.encode())
    h.update(np.ascontiguousarray(trace.token_ids_S[:trace.prompt_len], dtype=np.int64).tobytes())
    return h.hexdigest()[:32]


def engine_for_prompt(key: str, engines: int) -> int | None:
    """The data-parallel engine core every replica reading the prompt blocks `key` (prompt_key) is
    sent to (None: one engine).

    Each engine core has its own prefix cache and vLLM's client sends an unpinned request to the
    least loaded one, so a replica would miss the prompt blocks an earlier replica cached on the
    other core (with 2 engines, half the time). Pinning by the key keeps a trace's replicas on one
    core and spreads distinct prompts over all of them."""
    return None if engines <= 1 else int(key, 16) % engines


def reusable_tokens(prompt_len: int, block_size: int) -> int:
    """Prompt tokens a replica can read from the cache: whole blocks before the last prompt token."""
    return (prompt_len - 1) // block_size * block_size
