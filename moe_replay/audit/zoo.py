"""The failures users of routing replay report, injected into correct routes; and correct routes written
in each pipeline's format. The audit's tests and `benchmarks/audit.py` share them, and a pipeline
author can run their own audit against them.

A `Sample` holds one sequence's tokens and its routes over the model's MoE layers ([T, L, K], row p
the route of position p: T = S - 1). Each `Fault` turns correct samples into what a broken pipeline
holds and says which `Cause` the audit must name:

| fault | what breaks | reported as |
| --- | --- | --- |
| `shift_forward`, `shift_back` | the prompt start or the last row counted otherwise: rows one position off | ms-swift #9799 |
| `other_sample` | an async data-parallel merge hands each sample the next one's routes | AReno #524 |
| `rows_dropped` | packed replay keeps 3 of every 5 rows (the rest zero) | a Megatron-LM fork's #217 |
| `rows_duplicated` | a row written twice (three quarters in): every later row one position late | packing |
| `layers_swapped` | MoE layers in reverse order | |
| `dense_gap` | MoE column j read from decoder layer j (dense layers not skipped) | |
| `mtp_collision` | one layer's routes overwritten by another router's (an MTP layer under its id) | NeMo-RL #3903 |
| `batch_first` | a Megatron list written [B, S] where Megatron reads [S, B] (Megatron format only) | miles #3146 |
| `other_weights` | routes of another weights version (`other`: that version's routes of the same tokens) | |
| `random` | ids drawn at random | |
| `tail_repeat` | the last 3 rows dropped and the gap filled by repeating the last kept row | |
| `tail_zero` | the last row left zero-padded | prime-rl #1807 |
| `prompt_end_zero` | the prompt's last row (the boundary token's) left zero-padded | prime-rl #1807, NeMo-RL #3485 |
| `prompt_shift` | the prompt's rows one position late, the completion's in place | |
| `sibling` | each even sample given its GRPO sibling's routes (`siblings`: the same prompts, other completions, added to the batch) | |
| `wrapped_uint8` | ids stored as uint8 on a model of more than 256 experts (ids mod 256) | prime-rl #3051 |
| `out_of_range` | physical ids of an EPLB layout (replicas of the first experts numbered from E on) | |

Legend: S tokens, T rows, L MoE layers, C decoder layers, K top-k, B samples, M = S * B.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..geometry import ModelGeometry
from .verdict import Cause


@dataclass(frozen=True)
class Sample:
    key: str
    token_ids_S: np.ndarray
    routes_TLK: np.ndarray
    """[S - 1, L, K] expert ids over the model's MoE layers."""
    prompt_len: int | None = None
    """The prompt's tokens (written with the routes in every format); None: half the tokens."""

    @property
    def prompt(self) -> int:
        return len(self.token_ids_S) // 2 if self.prompt_len is None else self.prompt_len


@dataclass(frozen=True)
class Fault:
    name: str
    cause: Cause
    apply: Callable[[list[Sample], ModelGeometry, dict[str, Any]], list[Sample]]
    formats: tuple[str, ...] = ("trace", "vllm", "sglang", "verl", "megatron")
    """The formats the fault is injected into (`batch_first` exists in Megatron's list layout only)."""
    needs_dense: bool = False
    """Only meaningful for a model with dense layers among its decoder layers."""
    min_experts: int = 0
    """Only meaningful for a model of more experts than this (ids wrapped through uint8: 256)."""
    context: tuple[str, ...] = ()
    """The `inject` context it needs: `other` (another weights version's samples of the same tokens),
    `siblings` (samples of the same prompts with other completions, routed by the model)."""


def _with(samples: list[Sample], fn: Callable[[int, Sample], np.ndarray]) -> list[Sample]:
    return [dataclasses.replace(s, routes_TLK=np.ascontiguousarray(fn(b, s))) for b, s in enumerate(samples)]


def _shift_forward(samples, g, ctx):
    return _with(samples, lambda b, s: np.concatenate([s.routes_TLK[1:], s.routes_TLK[-1:]]))


def _shift_back(samples, g, ctx):
    return _with(samples, lambda b, s: np.concatenate([s.routes_TLK[:1], s.routes_TLK[:-1]]))


def _other_sample(samples, g, ctx):
    n = len(samples)

    def take(b, s):
        src = samples[(b + 1) % n].routes_TLK
        return np.concatenate([src, s.routes_TLK[len(src):]])[: len(s.routes_TLK)]

    return _with(samples, take)


def _rows_dropped(samples, g, ctx):
    def keep(b, s):
        r = s.routes_TLK
        kept = r[[p for p in range(len(r)) if p % 5 < 3]]
        return np.concatenate([kept, np.zeros((len(r) - len(kept),) + r.shape[1:], r.dtype)])

    return _with(samples, keep)


def _rows_duplicated(samples, g, ctx):
    def dup(b, s):
        r = s.routes_TLK
        at = 3 * len(r) // 4  # late: most rows still line up, the sample's mean passes; its windows do not
        return np.concatenate([r[: at + 1], r[at: -1]])

    return _with(samples, dup)


def _layers_swapped(samples, g, ctx):
    return _with(samples, lambda b, s: s.routes_TLK[:, ::-1])


def _dense_gap(samples, g, ctx):
    def by_decoder_column(b, s):
        dense = decoder_columns(s.routes_TLK, g)
        return dense[:, : g.num_moe_layers]

    return _with(samples, by_decoder_column)


def _mtp_collision(samples, g, ctx):
    other: list[Sample] = ctx["other"]
    j = min(1, g.num_moe_layers - 1)

    def overwrite(b, s):
        r = s.routes_TLK.copy()
        r[:, j] = other[b].routes_TLK[:, j]
        return r

    return _with(samples, overwrite)


def _other_weights(samples, g, ctx):
    other: list[Sample] = ctx["other"]
    return _with(samples, lambda b, s: other[b].routes_TLK)


def _random(samples, g, ctx):
    rng = np.random.default_rng(ctx.get("seed", 0))
    return _with(samples, lambda b, s: np.argsort(rng.random(s.routes_TLK.shape[:2] + (g.num_experts,)), -1)[..., : g.top_k])


def _tail_repeat(samples, g, ctx):
    def fill(b, s):
        r = s.routes_TLK.copy()
        r[-3:] = r[-4]
        return r

    return _with(samples, fill)


def _tail_zero(samples, g, ctx):
    def zero(b, s):
        r = s.routes_TLK.copy()
        r[-1] = 0
        return r

    return _with(samples, zero)


def _prompt_end_zero(samples, g, ctx):
    def zero(b, s):
        r = s.routes_TLK.copy()
        r[s.prompt - 1] = 0
        return r

    return _with(samples, zero)


def _prompt_shift(samples, g, ctx):
    """Rows 1 .. P - 1 hold positions 0 .. P - 2 (row 0 kept): the prompt one position late."""
    return _with(samples, lambda b, s: np.concatenate([s.routes_TLK[:1], s.routes_TLK[: s.prompt - 1], s.routes_TLK[s.prompt:]]))


def _sibling(samples, g, ctx):
    siblings: list[Sample] = ctx["siblings"]
    swapped = [dataclasses.replace(s, routes_TLK=siblings[b].routes_TLK.copy()) if b % 2 == 0 else s
               for b, s in enumerate(samples)]
    return swapped + [dataclasses.replace(x, key=f"{x.key}-sibling") for x in siblings]


def _wrapped_uint8(samples, g, ctx):
    return _with(samples, lambda b, s: s.routes_TLK % 256)


def _out_of_range(samples, g, ctx):
    replicas = max(1, g.num_experts // 4)

    def physical(b, s):
        r = s.routes_TLK.copy()
        odd = (np.arange(len(r)) % 2 == 1)[:, None, None]
        return np.where(odd & (r < replicas), r + g.num_experts, r)

    return _with(samples, physical)


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("shift_forward", Cause.SHIFTED, _shift_forward),
    Fault("shift_back", Cause.SHIFTED, _shift_back),
    Fault("other_sample", Cause.OTHER_SAMPLE, _other_sample),
    Fault("rows_dropped", Cause.ROWS, _rows_dropped),
    Fault("rows_duplicated", Cause.ROWS, _rows_duplicated),
    Fault("layers_swapped", Cause.LAYERS, _layers_swapped),
    Fault("dense_gap", Cause.LAYERS, _dense_gap, needs_dense=True),
    Fault("mtp_collision", Cause.LAYERS, _mtp_collision, context=("other",)),
    Fault("batch_first", Cause.OTHER_SAMPLE, lambda samples, g, ctx: samples, formats=("megatron",)),
    Fault("other_weights", Cause.OTHER_WEIGHTS, _other_weights, context=("other",)),
    Fault("random", Cause.RANDOM, _random),
    Fault("tail_repeat", Cause.TAIL_ROWS, _tail_repeat),
    Fault("tail_zero", Cause.TAIL_ROWS, _tail_zero),
    Fault("prompt_end_zero", Cause.TAIL_ROWS, _prompt_end_zero),
    Fault("prompt_shift", Cause.PROMPT_SHIFT, _prompt_shift),
    Fault("sibling", Cause.OTHER_SAMPLE, _sibling, context=("siblings",)),
    Fault("wrapped_uint8", Cause.WRAPPED_IDS, _wrapped_uint8, min_experts=256),
    Fault("out_of_range", Cause.OUT_OF_RANGE, _out_of_range, formats=("vllm", "sglang", "verl", "megatron")),
)}
"""Every fault by name (module docstring)."""


def decoder_columns(routes_TLK: np.ndarray, g: ModelGeometry) -> np.ndarray:
    """[T, C, K] over every decoder layer, dense layers' columns zero (vLLM's and SGLang's layout)."""
    out = np.zeros((len(routes_TLK), g.num_layers, routes_TLK.shape[-1]), dtype=routes_TLK.dtype)
    out[:, list(g.moe_layer_ids)] = routes_TLK
    return out


def write(samples: Sequence[Sample], fmt: str, g: ModelGeometry, *, batch_first: bool = False) -> tuple[Any, Any, dict]:
    """(routes, token_ids, keyword arguments) for `moe_replay.audit(model, routes, token_ids, format=fmt, **kw)`:
    the samples as that pipeline holds them. `batch_first`: the Megatron lists written [B, S]."""
    keys = [s.key for s in samples]
    prompts = [s.prompt for s in samples]
    if fmt == "trace":
        from ..trace import RolloutTrace

        return [RolloutTrace(s.key, s.token_ids_S, s.prompt, g, routes_TLK=s.routes_TLK.astype(np.int64)
                             .clip(0, g.num_experts - 1)) for s in samples], None, {}
    if fmt == "vllm":
        dtype = np.uint8 if g.num_experts <= 256 else np.uint16
        return ([decoder_columns(s.routes_TLK, g).astype(dtype) for s in samples], [s.token_ids_S for s in samples],
                {"prompt_start": 0, "keys": keys, "prompt_len": prompts})
    if fmt == "sglang":
        payloads = [base64.b64encode(decoder_columns(s.routes_TLK, g).astype("<i4").tobytes()).decode() for s in samples]
        return payloads, [s.token_ids_S for s in samples], {"start_len": 0, "keys": keys, "prompt_len": prompts}
    s_max = max(len(s.token_ids_S) for s in samples)
    ids_BS = np.zeros((len(samples), s_max), dtype=np.int64)
    mask_BS = np.zeros((len(samples), s_max), dtype=np.int64)
    for b, s in enumerate(samples):
        ids_BS[b, : len(s.token_ids_S)], mask_BS[b, : len(s.token_ids_S)] = s.token_ids_S, 1
    if fmt == "verl":
        import torch

        re = np.zeros((len(samples), s_max, g.num_layers, g.top_k), dtype=np.int16)
        for b, s in enumerate(samples):
            re[b, : len(s.routes_TLK)] = decoder_columns(s.routes_TLK, g)
        return (torch.from_numpy(re), torch.from_numpy(ids_BS),
                {"attention_mask": torch.from_numpy(mask_BS), "keys": keys, "prompt_len": prompts})
    if fmt == "megatron":
        import torch

        b_count = len(samples)
        lists = []
        for j in range(g.num_moe_layers):
            ids = np.zeros((b_count, s_max, g.top_k), dtype=np.int64)
            for b, s in enumerate(samples):
                ids[b, : len(s.routes_TLK)] = s.routes_TLK[:, j]
            flat = ids.reshape(b_count * s_max, -1) if batch_first else ids.transpose(1, 0, 2).reshape(s_max * b_count, -1)
            lists.append(torch.from_numpy(np.ascontiguousarray(flat)))
        return lists, torch.from_numpy(ids_BS), {"attention_mask": torch.from_numpy(mask_BS), "keys": keys, "prompt_len": prompts}
    raise ValueError(f"unknown format {fmt!r}; expected one of trace, vllm, sglang, verl, megatron")


def inject(fault: Fault, samples: list[Sample], fmt: str, g: ModelGeometry, **ctx: Any) -> tuple[Any, Any, dict]:
    """`write` of the samples after `fault` (ctx: what `fault.context` names)."""
    missing = [name for name in fault.context if name not in ctx]
    if missing:
        raise ValueError(f"fault {fault.name!r} needs inject(..., {', '.join(f'{m}=...' for m in missing)})")
    return write(fault.apply(list(samples), g, ctx), fmt, g, batch_first=fault.name == "batch_first")
