"""What every number of the demo report means: one entry per metric key the report's tables print.

The HTML page's headers and the terminal table's titles come from here (`title`), and the page's
glossary section prints every entry with its raw key, its unit and its range, so a reader never
has to guess from a key like `chi2_token`. `undocumented` lists the columns of a report that have
no entry; the tests run it on a real demo report, so a new column without an entry fails them.
LAB_GLOSSARY does the same for `moe-replay lab`'s report (lab.json's keys; docs/lab.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    title: str
    """Human-readable column header (short: it heads a table column)."""
    unit: str
    """Unit and range, e.g. "nats per token, >= 0"."""
    meaning: str
    """What it measures, which values are expected, and when it can be negative or missing."""


NOT_MEASURED = "n/a"
"""What a table cell shows where an arm does not measure a metric (absent from its record)."""

GLOSSARY: dict[str, Term] = {
    # the arms table and the terminal table
    "arm": Term("arm", "name", "One GRPO run under one preset. Every arm starts from the same weights and sees the "
                "same prompts and sampling seeds, so arms differ only by the fix the preset switches on."),
    "preset": Term("preset", "name", "The preset (configs/<name>.yaml) that configures capture, replay, the π_old "
                   "estimator and the off-policy corrections of this arm."),
    "description": Term("description", "text", "The preset's own one-line description."),
    "steps": Term("steps", "count", "GRPO steps run in this arm."),
    "setting": Term("setting", "name", "A setting of the run (moe_replay.demo.DemoConfig and what the demo derived)."),
    "value": Term("value", "as set", "The value it had in this run."),
    # per-step and per-arm metrics
    "step": Term("step", "index from 0", "GRPO step number within the arm."),
    "route_flip_rate": Term(
        "route-flip rate", "fraction of (token, MoE layer) pairs, 0 to 1",
        "Share of routed (token position, MoE layer) pairs where the set of experts that ran in the trainer's "
        "forward differs from the set the rollout engine chose. 0 under replay: the trainer is forced onto the "
        "engine's experts."),
    "free_route_flip_rate": Term(
        "free-routing flip rate", "fraction of (token, MoE layer) pairs, 0 to 1",
        "The same count for the experts the trainer's own router would have chosen. In an arm that replays "
        "routes it is measured before the forcing, so it shows how many flips replay removed; in an arm that "
        "does not replay it equals the route-flip rate."),
    "k3_kl": Term(
        "k3-KL (train vs rollout)", "nats per token, >= 0",
        "Token mean of ρ - 1 - log ρ with ρ = π_train / π_rollout of the sampled token (verl's rollout_corr/k3_kl): "
        "an estimate of KL(π_rollout || π_train), the mismatch between the engine that sampled and the trainer "
        "(in 'none', which scores over the full vocabulary, it includes the sampler's top-p truncation). Every term is >= 0, so it is never negative; 0 means the trainer reproduces the engine's logprobs exactly."),
    "kl": Term(
        "KL, k1 estimate", "nats per token, either sign",
        "Token mean of log π_rollout - log π_train (verl's rollout_corr/kl): the same KL as k3-KL, estimated by the "
        "plain log-ratio of the sampled tokens, so each term has either sign. The engine's logprob is taken under "
        "the distribution it sampled from (after top-p), so in an arm that scores over the full vocabulary "
        "('none') π_rollout > π_train on most tokens and the mean is positive (about -log of the kept probability "
        "mass). Under replay + support both sides use the same kept set, the true KL is small (about 1e-3) and "
        "sampling noise decides the sign of a step's mean: negative values there are expected. A sample estimate, "
        "not a divergence: read k3-KL for the size."),
    "chi2_token": Term(
        "χ² (token)", "dimensionless, either sign",
        "Token mean of ρ² - 1 (verl's rollout_corr/chi2_token): an estimate of the χ² divergence, the variance of "
        "the importance weight. The divergence is >= 0, but this sample estimate is below 0 whenever the sampled "
        "tokens' ρ² average below 1. In 'none' that is systematic: the trainer spreads probability over the whole "
        "vocabulary while the engine sampled from the kept set, so the expected ρ is the trainer's mass on that set, "
        "below 1. Under replay + support the expected ρ is 1 and noise decides the sign."),
    "max_abs_logprob_diff": Term(
        "max |Δ logprob|", "nats, >= 0",
        "Largest |log π_train - log π_rollout| over the step's generated tokens (for the per-arm mean: the mean of "
        "the per-step maxima)."),
    "mean_abs_logprob_diff": Term(
        "mean |Δ logprob|", "nats per token, >= 0", "Mean |log π_train - log π_rollout| over the step's generated tokens."),
    "ppl_ratio": Term(
        "perplexity ratio (train / rollout)", "ratio, > 0, 1 = agreement",
        "Sequence mean of exp(mean log π_rollout - mean log π_train): the trainer's perplexity of each rollout over "
        "the engine's (verl's rollout_corr/ppl_ratio)."),
    "is_ess": Term(
        "IS effective sample size", "fraction, 0 to 1",
        "(Σρ)² / (n Σρ²) over the step's tokens (moe_replay/is_ess_token): 1 when every importance weight is equal, "
        "lower when a few tokens carry the weight."),
    "k3_kl_vs_pi_old": Term(
        "k3-KL (train vs π_old)", "nats per token, >= 0",
        "k3-KL between the trainer's logprobs and the π_old the estimator returned (each rollout re-scored n times on "
        "the engine under its routes and support, probabilities averaged). Only arms whose preset estimates π_old "
        f"measure it; the others show {NOT_MEASURED} (absent from report.json, not an error)."),
    "tokens": Term(
        "generated tokens", "count",
        "Tokens the step's rollouts generated (every completion up to its end-of-sequence token or the token limit). "
        "Arms differ once their weights do: a completion that samples its end-of-sequence token early is shorter."),
    "entropy": Term(
        "entropy", "nats per token, >= 0",
        "Mean entropy of the trainer's next-token distribution at the generated positions; over the sampler's kept "
        "set when the preset renormalises over the support, so replay + support arms read lower than 'none'."),
    "loss": Term(
        "loss", "dimensionless, either sign",
        "The GRPO clipped-surrogate loss of the step's update (token mean of -min(ρ A, clip(ρ) A), times the "
        "preset's correction weights). With π_old the trainer's own recompute the ratio is 1 and the value is minus "
        "the token-weighted mean advantage: group-normalised advantages sum to 0 in each group, so it sits near 0 "
        "with either sign; the gradient, not the value, moves the policy. Exactly 0 where every group's rewards "
        "are equal (all advantages 0: nothing to learn from, as in the first steps, before any rollout earns a reward)."),
    "reward": Term(
        "mean reward", "0 to 1",
        "Mean reward of the step's rollouts: 1 for the right answer first, 0.2 for a wrong number first, 0 otherwise "
        "(moe_replay/demo/task.py). Arms whose policies stay close sample the same completions from the same seeds "
        "and earn the same rewards; the reward plot names arms whose lines coincide."),
    "wall_s": Term(
        "wall time per step (s)", "seconds per step",
        "Wall-clock seconds of one step of this arm: rollouts, π_old re-scoring (multi-sample arms), the update and "
        "the weight sync into the engine. It moves with the machine's load: compare arms of one run, on a quiet machine."),
    # the engine-noise section (report.json: engine_noise; moe_replay/demo/noisy.py)
    "n": Term("n", "replicas, >= 1",
              "Re-scorings of each rollout the estimator averages (in probability) into one π_old, engine-noise section."),
    "pi_old_abs_diff": Term(
        "mean |π_old - rollout| (log)", "nats per token, >= 0",
        "Engine-noise section: mean over tokens and estimates of |log π_old - log π_rollout|, π_old the n-replica estimate "
        "and π_rollout the logprob the engine recorded while sampling. Without the instrument the CPU engine's "
        "re-scores equal the rollout's to <= 1e-6 nats (bf16 prefill vs decode); under it the rollout ran one numerics "
        "variant and the replicas a mix of them, so it is > 0 at every n: π_old visibly differs from the rollout's."),
    "pi_old_max_abs_diff": Term(
        "max |π_old - rollout| (log)", "nats, >= 0", "Engine-noise section: the largest such difference over tokens and estimates."),
    "pi_old_var": Term(
        "var π_old", "probability², >= 0",
        "Engine-noise section: mean over tokens of the variance (ddof 1) of π_old, as a probability, across independent "
        "n-replica estimates, each under its own placements (moe_replay.lab.arms.variance_ratio). 0 would mean "
        "every replica agreed: no noise to average."),
    "pi_old_variance_ratio": Term(
        "var ratio to n = 1", "ratio, >= 0",
        "Engine-noise section: variance of π_old at n over the variance at n = 1 (engine_noise.estimator.variance_ratio). "
        "Averaging n independent replicas gives 1/n; with few estimates (4 at n = 8) the measured ratio scatters around it."),
    "inverse_n": Term("1/n", "ratio", "What averaging n independent replicas gives: the variance ratio to compare with."),
    "pi_old_source": Term(
        "π_old", "source", "Engine-noise section: what the PPO ratio divides by, the rollout's recorded logprobs or the "
        "estimator's n-replica average."),
    "phantom_clip_fraction": Term(
        "phantom clip", "fraction of tokens, 0 to 1",
        "Engine-noise section: tokens whose PPO ratio π_train / π_old leaves [1 - ε, 1 + ε] at the first minibatch, "
        "where trainer and engine hold the same weights: every such clip is caused by the mismatch, not by an update. "
        "The trainer replays routes and support, so what is left is bf16 precision and the engine's noise."),
}
"""Metric key (as in report.json) -> its entry."""

PLOT_GLOSSARY: dict[str, str] = {
    "route_agreement": (
        "One bar per MoE layer and arm: 1 - route-flip rate of that layer, averaged over steps (1 = the trainer ran "
        "exactly the engine's experts at every routed position). The axis starts just below the lowest bar, as its "
        "label says, so small differences show."),
    "logprob_diff_hist": (
        "Distribution of |log π_train - log π_rollout| (nats) over every generated token of every step, as a fraction "
        "of the arm's tokens; both axes are logarithmic. The first bin holds exact agreement (below 1e-8): in arms "
        "that score over the kept set, every token top-p kept alone has logprob 0 on both sides. The legend's "
        "n is the arm's token count: the tokens its rollouts generated, which differ between arms when their "
        "completions differ in length (see the note below the plot)."),
    "k3_kl": (
        "k3-KL (train vs rollout) per step, log scale. Values below the floor (exact zeros) sit on it as hollow "
        "triangles. Each arm has its own line style and marker, so lines that coincide stay visible; the title "
        "names them."),
    "reward": (
        "Mean reward per step. Each arm has its own line style and marker; where two arms sampled the same "
        "completions their lines coincide, and the title names them."),
    "pi_old_variance": (
        "Engine-noise section (an instrument, not a GPU result): the variance of π_old across independent estimates "
        "vs the replicas n each averages, both axes logarithmic; the dashed line is n = 1's variance times 1/n, what "
        "independent replicas give. Drawn only when the demo ran the section."),
}
"""Plot name (plots.PLOTS, noise_section.NOISE_PLOT) -> how to read it."""

LAB_GLOSSARY: dict[str, Term] = {
    "arm": Term("arm", "name", "One remedy, scored on the same rollouts with the same fixed per-rollout advantages as "
                "every other arm: the preset's replay switches (and π_old estimator) plus the remedy's own correction, "
                "every other correction stripped (moe_replay.lab.arms.ARMS)."),
    "pi_old": Term("π_old", "source", "What the PPO ratio divides by: the engine's logprobs of the rollout, or the "
                   "estimator's average of n re-scorings (the multi-sample arm)."),
    "corrections": Term("corrections", "names", "The off-policy corrections the arm applies (TIS, MIS, IcePop); "
                        "none for replay-only arms."),
    "phantom_clip_fraction": Term(
        "phantom clip", "fraction of kept tokens, 0 to 1",
        "Kept tokens whose PPO ratio π_trainer / π_old leaves [1 - ε, 1 + ε] (ε = 0.2) at the first minibatch, where "
        "the weights are identical: every such clip is phantom, caused by the engine-trainer mismatch alone."),
    "k3_kl": Term(
        "k3-KL (train vs rollout)", "nats per token, >= 0",
        "Token mean of ρ - 1 - log ρ, ρ = π_trainer / π_rollout of the sampled token (rollout_corr/k3_kl): the "
        "mismatch between the engine that sampled and the trainer."),
    "flip_rate": Term(
        "route flips", "fraction of (token, MoE layer) pairs, 0 to 1",
        "Pairs where the experts the trainer ran differ from the trace's (moe_replay/route_flip_rate); 0 under replay."),
    "is_ess_token": Term(
        "IS ESS (token)", "fraction, 0 to 1",
        "Normalised effective sample size (Σρ)² / (n Σρ²) of the raw ratio over tokens: 1 when every weight is equal."),
    "max_ratio": Term("max ratio", "ratio, > 0", "Largest raw ratio π_trainer / π_old over the tokens."),
    "max_is_weight": Term("max IS weight", "weight, >= 0",
                          "Largest weight the arm's corrections put on a kept token (1 for arms without corrections)."),
    "masked_fraction": Term("masked", "fraction of tokens, 0 to 1", "Tokens the arm's corrections mask out of the loss."),
    "k3_kl_vs_pi_old": Term(
        "k3-KL (train vs π_old)", "nats per token, >= 0",
        "k3-KL between the trainer and the estimator's π_old; only arms whose π_old is estimated measure it."),
    "grad_cos_to_reference": Term(
        "gradient cosine", "cosine, -1 to 1, 1 = same direction",
        "Cosine between the arm's gradient of Σ w min(ρA, clip(ρ)A) and the reference, the on-policy gradient "
        "Σ A ∇ log π_trainer (free routing, fp32, ratio 1)."),
    "grad_cos_ci95": Term(
        "cosine 95% interval", "cosine interval",
        "95% percentile bootstrap interval of the cosine over groups of rollouts (coarse with few groups)."),
    "rel_err": Term("gradient rel. error", "ratio, >= 0", "|g_arm - g_ref| / |g_ref| of the summed gradients."),
    "rel_err_ci95": Term("rel. error 95% interval", "ratio interval", "Bootstrap interval of the relative error."),
    "tokens": Term("generated tokens", "count", "Generated tokens of the rollouts every arm scores (rollouts x tokens)."),
    "n": Term("n", "replicas", "Re-scorings the estimator averages into one π_old."),
    "var": Term("variance of π_old", "probability², >= 0",
                "Mean over tokens of the variance of π_old (a probability) across independent estimates, each under "
                "other placements (estimate()'s shuffle placement, batches filled to a noise bucket size)."),
    "variance_ratio": Term("variance ratio", "ratio to n = 1, >= 0",
                           "Variance at n over the variance at n = 1; 1/n for independent replicas; n/a (null in "
                           "lab.json) where n = 1's variance is 0: no noise to reduce."),
    "one_over_n": Term("1/n", "ratio", "What averaging n independent replicas would give."),
    "target": Term("target", "name", "A target of the issue (moe_replay.lab.arms.targets_report)."),
    "rule": Term("rule", "text", "What must hold."),
    "measured": Term("measured", "numbers", "The numbers the rule compares, from this run."),
    "met": Term("met", "yes / no / n/a", "Whether the rule holds on this run; n/a where its condition does not apply or a "
                 "number it compares could not be computed (null in lab.json)."),
}
"""Key of a `moe-replay lab` JSON (lab.json) or its report's tables -> its entry (docs/lab.md's meanings)."""

LAB_PLOT_GLOSSARY: dict[str, str] = {
    "lab_phantom_clip": (
        "One bar per arm: the fraction of kept tokens PPO-clipped at the first minibatch, before any update. Every "
        "such clip is caused by the engine-trainer mismatch alone."),
    "lab_grad_cos": (
        "Cosine of each arm's gradient to the reference (on-policy, free routing, fp32) with its 95% bootstrap "
        "interval as error bars; the axis starts just below the lowest interval so differences show."),
    "lab_variance": (
        "Variance of π_old across independent estimates vs the replicas n averaged, both axes logarithmic; the dashed "
        "line is the n = 1 variance times 1/n, what independent replicas would give."),
}
"""Lab plot name (moe_replay/lab/plots.LAB_PLOTS) -> how to read it."""


def lab_title(key: str) -> str:
    """The lab report's column header for `key` (LAB_GLOSSARY), or the key itself when unknown."""
    term = LAB_GLOSSARY.get(key)
    return term.title if term is not None else key


PATTERNS: tuple[tuple[re.Pattern[str], Term], ...] = (
    (re.compile(r"moe_replay/corr/(?P<name>[^/]+)/token_masked_fraction"),
     Term("{name}: tokens masked", "fraction of response tokens, 0 to 1",
          "Tokens the '{name}' correction rejected or zero-weighted (docs/corrections.md).")),
    (re.compile(r"moe_replay/corr/(?P<name>[^/]+)/seq_masked_fraction"),
     Term("{name}: sequences masked", "fraction of sequences, 0 to 1",
          "Sequences the '{name}' correction rejected at least one token of.")),
    (re.compile(r"moe_replay/corr/token_masked_fraction"),
     Term("tokens masked", "fraction of response tokens, 0 to 1",
          "1 - kept / response tokens after every correction of the preset.")),
    (re.compile(r"moe_replay/corr/seq_masked_fraction"),
     Term("sequences masked", "fraction of sequences, 0 to 1", "Sequences with at least one rejected token.")),
    (re.compile(r"rollout_corr/rollout_rs_masked_fraction"),
     Term("rejection-sampling masked", "fraction of response tokens, 0 to 1",
          "Tokens out of the loss denominator (verl's rollout_corr/rollout_rs_masked_fraction).")),
)
"""Families of keys named after a correction: (full-match pattern, entry with {name} filled in)."""


def lookup(key: str) -> Term | None:
    """The entry for `key`, or None when the glossary does not know it."""
    if key in GLOSSARY:
        return GLOSSARY[key]
    for pattern, term in PATTERNS:
        m = pattern.fullmatch(key)
        if m:
            fill = m.groupdict()
            return Term(term.title.format(**fill), term.unit, term.meaning.format(**fill))
    return None


def title(key: str) -> str:
    """The column header for `key`: its entry's title, or the key itself when unknown."""
    term = lookup(key)
    return term.title if term is not None else key


def undocumented(keys) -> list[str]:
    """The keys, in order and without repeats, that have no glossary entry."""
    return [k for k in dict.fromkeys(keys) if lookup(k) is None]


__all__ = ["GLOSSARY", "LAB_GLOSSARY", "LAB_PLOT_GLOSSARY", "NOT_MEASURED", "PATTERNS", "PLOT_GLOSSARY", "Term", "lab_title",
           "lookup", "title", "undocumented"]
