"""Which TRL GRPOTrainer options moe_replay works with, and a refusal by name for the others.

Checked before TRL builds anything (no vLLM engine is started for a configuration that cannot
run). Everything not named here is left as the user set it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ...presets import Preset


_PENALTY_WHY = ("vLLM applies it to the logits before top-k/top-p and before the sampled logprob; the trainer's "
                "forward knows nothing of it, so replayed logprobs would be of another distribution than the "
                "one that sampled (the kept set alone does not carry the shifted logits)")
_LOGIT_CHANGING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None,
                   "logits_processors": None}
"""SamplingParams fields (through GRPOConfig.generation_kwargs) that shift logits, with their neutral
value. Masks are fine (allowed/bad words, min_tokens, structured outputs): they only remove tokens,
which the captured kept set records."""


class TrlOptionError(ValueError):
    """A TRL option moe_replay cannot honour; the message names the option, its value and the fix."""

    def __init__(self, option: str, found: Any, expected: str, why: str) -> None:
        self.option, self.found, self.expected = option, found, expected
        super().__init__(f"moe_replay: TRL option {option}={found!r} is not supported (expected {expected}): {why}")


def check_options(args: Any, trainer_kwargs: Mapping[str, Any], preset: Preset) -> None:
    """Raise TrlOptionError for the first GRPOConfig field or GRPOTrainer argument moe_replay refuses."""
    if args is None:
        raise TrlOptionError("args", None, "a GRPOConfig(use_vllm=True, vllm_mode='colocate', ...)",
                             "TRL's default config generates with transformers, where nothing is captured")
    if not args.use_vllm:
        raise TrlOptionError("use_vllm", args.use_vllm, "True",
                             "routes and sampling supports are captured inside vLLM; transformers generation records neither")
    if args.vllm_mode != "colocate":
        raise TrlOptionError("vllm_mode", args.vllm_mode, "'colocate'",
                             "a `trl vllm-serve` server answers over HTTP with tokens and logprobs only, so its routes "
                             "and supports never reach the trainer")
    if args.vllm_tensor_parallel_size != 1 and preset.estimator.enabled:
        raise TrlOptionError("vllm_tensor_parallel_size", args.vllm_tensor_parallel_size, "1 with an estimator preset",
                             f"preset {preset.name!r} re-scores each rank's own traces on the engine, but the ranks of a "
                             "tensor-parallel group share one engine and must submit the same requests together")
    for name, why in (
        ("rollout_func", "a custom rollout generates outside the captured engine call"),
        ("tools", "tool results are spliced into the completion: tokens the engine never sampled in one request"),
        ("environment_factory", "environment turns splice tokens the engine never sampled into the completion"),
    ):
        if trainer_kwargs.get(name):
            raise TrlOptionError(name, type(trainer_kwargs[name]).__name__, "None", why)
    if args.use_liger_kernel:
        raise TrlOptionError("use_liger_kernel", True, "False",
                             "Liger swaps the model's layer modules for its Triton kernels when training starts, after "
                             "moe_replay found the routers it replays and checked the model against the engine")
    if args.repetition_penalty != 1.0:
        raise TrlOptionError("repetition_penalty", args.repetition_penalty, "1.0", _PENALTY_WHY)
    gen_kwargs = args.generation_kwargs or {}
    gen_kwargs = json.loads(gen_kwargs) if isinstance(gen_kwargs, str) else gen_kwargs
    for key in sorted(set(gen_kwargs) & set(_LOGIT_CHANGING)):
        value, neutral = gen_kwargs[key], _LOGIT_CHANGING[key]
        if (value != neutral) if neutral is not None else bool(value):
            raise TrlOptionError(f"generation_kwargs[{key!r}]", value, repr(_LOGIT_CHANGING[key]), _PENALTY_WHY)
    if preset.corrections and not args.vllm_importance_sampling_correction:
        names = [c.name for c in preset.corrections]
        raise TrlOptionError("vllm_importance_sampling_correction", False, "True",
                             f"preset {preset.name!r} applies corrections {names} through TRL's importance-sampling "
                             f"slot, which this setting turns off (or use a preset without corrections)")
    if not preset.capture.routes and preset.replay.routes:
        raise TrlOptionError("moe_replay", preset.name, "capture.routes: true", "the preset replays routes it does not capture")
    if not preset.capture.support and preset.replay.support:
        raise TrlOptionError("moe_replay", preset.name, "capture.support: true", "the preset renormalises over supports it does not capture")
    if not preset.capture.logprobs:
        raise TrlOptionError("moe_replay", preset.name, "capture.logprobs: true",
                             "the mismatch metrics and corrections compare against the engine's logprobs")
