"""SGLang traces against HF transformers (fp32, the project's venv): what "exact" is measured as.

`compare_hf(model_dir, traces)` replays the traces in the HF model on one padded batch and returns:
  flips                 token-layers where HF's own router would pick other experts than the trace's (replay's
                        flip count; 0 = SGLang routed every row as HF does, in order)
  positions             token-layers compared
  max_abs_dlogprob      max |HF - SGLang| of the sampled tokens' logprobs over the recorded kept sets, at
                        the recorded temperature, under the trace's routes
  kept_sets_equal_hf    every recorded kept set equals the one SGLang's definition keeps over HF's logits
                        (sglang_support: top-k and top-p both over the whole distribution, then min-p)
  kept_rows             kept sets compared
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import numpy as np
import torch


def sglang_support(logits_GV: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> list[np.ndarray]:
    """Kept sets per row by SGLang 0.5.23's definition (its torch sampler, top_k_top_p_min_p_sampling_from_probs_torch),
    written here from that definition in float64: probabilities at the temperature, sorted; a token is kept if its
    rank < top_k and the mass before it <= top_p, both over the whole distribution (vLLM and HF take top-p over
    the top-k renormalised: a larger set here), then if p >= min_p * p_max. Greedy (temperature 0): the argmax."""
    rows = []
    for row in logits_GV:
        if temperature == 0:
            rows.append(np.array([int(row.argmax())]))
            continue
        p = (row / temperature).softmax(-1)
        p_sorted, order = p.sort(descending=True)
        keep = torch.ones_like(p_sorted, dtype=torch.bool)
        if top_k > 0:
            keep[top_k:] = False
        keep &= (p_sorted.cumsum(0) - p_sorted) <= top_p
        if min_p > 0:
            keep &= p_sorted >= p_sorted[0] * min_p
        rows.append(np.sort(order[keep].numpy()))
    return rows


def compare_hf(model_dir: str | os.PathLike, traces: Sequence[Any]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.hf.replay import model_geometry, output_tensor, replay
    from moe_replay.replay import build_plan, score_tokens

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    plan = build_plan(list(traces), model_geometry(model))
    with torch.no_grad(), replay(model, plan, track_flips=True) as session:
        logits_BSV = output_tensor(model(**session.model_inputs()))
    delta_G = (score_tokens(logits_BSV, plan).logprobs_G.double() - plan.engine_logprobs_G.double()).abs()
    rows_GV = logits_BSV.reshape(-1, logits_BSV.shape[-1])[plan.score_pos_G].double()
    equal, rows = True, 0
    for b, t in enumerate(traces):
        s = t.sampling
        lo, hi = plan.gen_offsets_B1[b], plan.gen_offsets_B1[b + 1]
        ref = sglang_support(rows_GV[lo:hi], s.temperature, s.top_k, s.top_p, s.min_p)
        for g, want in enumerate(ref):
            rows += 1
            equal &= np.array_equal(np.asarray(t.support.row(g), dtype=np.int64), want.astype(np.int64))
    return dict(flips=int(sum(session.flips.flips.values())), positions=int(sum(session.flips.positions.values())),
                max_abs_dlogprob=float(delta_G.max()), kept_sets_equal_hf=bool(equal), kept_rows=rows,
                tokens=int(delta_G.numel()))


def shifted(trace: Any) -> Any:
    """The trace with every expert id moved by one (mod E): distinct ids per row, experts neither engine chose."""
    g = trace.geometry
    return dataclasses.replace(trace, key=trace.key + "-shifted",
                               routes_TLK=((trace.routes_TLK.astype(np.int64) + 1) % g.num_experts).astype(g.route_dtype))


def compare_scores(model_dir: str | os.PathLike, traces: Sequence[Any], scores: dict[str, np.ndarray]) -> dict[str, Any]:
    """SGLang's forced scores (tests/sglang_bed/score_driver.py: `own` routes, `shifted` routes, flat [G]) against
    HF's replay of the same routes over the same kept sets: max |Δ| each, how far shifting moved the scores, and
    HF's recompute time (one fp32 forward of the batch under replay: what the estimator's cost is set against)."""
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.hf.replay import model_geometry, output_tensor, replay
    from moe_replay.replay import build_plan, score_tokens

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out: dict[str, Any] = {}
    seconds = []
    for name, batch in [("own", list(traces)), ("shifted", [shifted(t) for t in traces])] + [("own", list(traces))] * 3:
        plan = build_plan(batch, model_geometry(model))
        t0 = time.perf_counter()
        with torch.no_grad(), replay(model, plan) as session:
            hf_G = score_tokens(output_tensor(model(**session.model_inputs())), plan).logprobs_G.double().numpy()
        seconds.append(time.perf_counter() - t0)
        out[f"{name}_max_abs_vs_hf"] = float(np.abs(hf_G - scores[name]).max())
    out["hf_recompute_s"] = min(seconds[2:])  # warm (the first forwards also probe the routers' rule), least loaded
    out["shift_moves_scores_by"] = float(np.abs(scores["own"] - scores["shifted"]).max())
    return out
