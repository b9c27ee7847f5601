"""Capture under speculative decoding (vLLM's V1 runner): the target model's routes of the tokens
kept, and the kept set of the target distribution each token was drawn from.

What one speculative step does (vLLM 0.26-0.33, `v1/sample/rejection_sampler.py`): request b
forwards its last sampled token at position p0 and n_b draft tokens at p0 + 1 .. p0 + n_b in one
target forward. The logits of position p0 + j (j < n_b) go through `apply_sampling_constraints`
(temperature, top-k, top-p) and decide whether draft j + 1 is accepted; the logits of p0 + n_b are
the bonus row, sampled by the engine's own Sampler (which truncates in `topk_topp_sampler`, as in a
plain step). `rejection_sample` returns [B, max_spec + 1] ids: the a_b accepted drafts, then one
recovered token (drawn from the target distribution without the rejected draft) or, when every draft
was accepted, the bonus token; -1 after. Standard rejection sampling is lossless: the token at
p0 + 1 + j is distributed exactly as the target distribution of row j (arXiv 2211.17192), whatever
the drafter proposed (n-gram, EAGLE, MTP, a draft model). So per emitted token the trace records:
  * the kept set: the finite entries of that target row (the constrained target logits for
    j < n_b, the bonus row's truncated logits for j = n_b), and the sampled token's logprob over it;
  * routes: positions p0 .. p0 + a_b were forwarded with the tokens the sequence keeps; the rows of
    p0 + a_b + 1 .. p0 + n_b were forwarded with rejected drafts and are dropped (the token that
    replaces one is forwarded at that position by a later step).
A drafter's own MoE layers (EAGLE / MTP heads, a draft model) run in another module than the
target model's and are never bound by capture (routes come from `runner.model` only, and the load
hook binds the target model only): they never enter a trace, so they cannot share a layer id with
the backbone (invariant 2). `SpecInfo.draft_moe_layers` names them.

What cannot be captured exactly is refused by name: `rejection_sample_method` other than
"standard" ('synthetic' accepts drafts at a fixed rate, not by probability: the emitted tokens are
not the target distribution's). The sampler options vLLM's rejection sampler would skip on draft
rows (min_p, logit_bias: `apply_logits_processors` there runs penalties, allowed / bad words and
min_tokens only) vLLM itself refuses with speculation (`SamplingParams._validate_spec_decode`,
0.26-0.33), so no request draws its draft and bonus tokens from two distributions.

Legend: B requests of the step, J = max_spec + 1 output slots, D draft rows (sum n_b), X emitted
tokens (sum a_b + 1), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CaptureHookError
from ..step import SpecRows
from ..versions import check_release

LOSSLESS_METHODS = ("standard",)
"""`SpeculativeConfig.rejection_sample_method` values whose emitted tokens follow the target
distribution exactly (vLLM 0.32 also has 'synthetic', a benchmarking mode, and 'block')."""

@dataclass(frozen=True)
class SpecInfo:
    """The speculative decoding an engine runs, as capture reads it at install."""

    method: str
    num_speculative_tokens: int
    draft_moe_layers: tuple[str, ...] = ()
    """Names of the drafter's MoE layers (never captured; see the module docstring)."""

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "draft_moe_layers": list(self.draft_moe_layers)}


def spec_info(runner: Any, path: str = "v1") -> SpecInfo | None:
    """The runner's speculative decoding, or None; refuses (CaptureHookError, by name) what capture
    cannot record exactly. Runs at install, before any wrapper is set; `path` is the runner's
    ("v1" or "mrv2": runners/, whose port wraps its rejection sampler)."""
    spec = getattr(runner, "speculative_config", None)
    if spec is None:
        return None
    check_release(runner=path, parts=("speculative",))  # the names this module and the runner's port read
    method = str(getattr(spec, "method", None))
    rsm = str(getattr(spec, "rejection_sample_method", "standard"))
    if rsm not in LOSSLESS_METHODS:
        raise CaptureHookError(
            f"speculative decoding ({method}) with rejection_sample_method={rsm!r}: expected one of "
            f"{list(LOSSLESS_METHODS)}; {rsm!r} does not accept draft tokens by the target probabilities, so the "
            "emitted tokens are not drawn from the distribution whose kept set capture records")
    if getattr(runner, "rejection_sampler", None) is None:
        raise CaptureHookError(f"speculative decoding ({method}) but runner {type(runner).__name__} has no "
                               "rejection_sampler to hook: capture reads draft rows' target distribution there")
    return SpecInfo(method, int(getattr(spec, "num_speculative_tokens", 0) or 0), _draft_moe_layers(runner))


def _draft_moe_layers(runner: Any) -> tuple[str, ...]:
    """Qualified names of MoE layers inside the drafter (EAGLE / MTP heads, a draft model)."""
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)  # V1 / Model Runner V2
    model = getattr(drafter, "model", None)
    if not isinstance(model, torch.nn.Module):
        return ()
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return tuple(f"drafter.{name}" for name, m in model.named_modules() if isinstance(m, MoERunner))


def spec_rows(sampled_BJ: torch.Tensor, num_draft_tokens: list[int]) -> tuple[SpecRows, np.ndarray]:
    """(the step's SpecRows, row of each emitted token in [draft rows; bonus rows]) from the
    rejection sampler's output; emitted tokens in batch order, then output slot order."""
    out_BJ = sampled_BJ.cpu().numpy() if sampled_BJ.device.type != "cpu" else sampled_BJ.numpy()
    drafts_B = np.asarray(num_draft_tokens, dtype=np.int64)
    B = len(drafts_B)
    if out_BJ.shape[0] != B:
        raise CaptureHookError(f"the rejection sampler emitted {out_BJ.shape[0]} rows for {B} requests")
    emitted_B = (out_BJ >= 0).sum(axis=1).astype(np.int64)
    if (emitted_B < 1).any() or (emitted_B > drafts_B + 1).any():
        b = int(np.flatnonzero((emitted_B < 1) | (emitted_B > drafts_B + 1))[0])
        raise CaptureHookError(f"request row {b} emitted {int(emitted_B[b])} tokens for {int(drafts_B[b])} drafts "
                               f"(expected 1 .. {int(drafts_B[b]) + 1})")
    D = int(drafts_B.sum())
    j_X = np.arange(int(emitted_B.sum())) - np.repeat(np.cumsum(emitted_B) - emitted_B, emitted_B)
    b_X = np.repeat(np.arange(B), emitted_B)
    first_B = np.cumsum(drafts_B) - drafts_B
    row_X = np.where(j_X < drafts_B[b_X], first_B[b_X] + j_X, D + b_X)
    return SpecRows(drafts_B, emitted_B), row_X


def emitted_tokens(sampled_BJ: torch.Tensor) -> torch.Tensor:
    """int64 [X, 1]: the emitted ids row by row (a fresh tensor; the placeholders dropped)."""
    flat = sampled_BJ.reshape(-1)
    return flat[flat >= 0].to(torch.int64).reshape(-1, 1)
