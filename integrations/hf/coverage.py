"""Which MoE families of the installed transformers replay, per precision mode, measured on tiny random models.

Families: every model type whose modeling module defines a router class (*Router, *Gating, or a
*Gate that reads a top_k), and every one whose config has more than one expert by default (MoE
blocks that route inline). For each, in each mode (PRECISIONS: fp32; bf16 weights as
from_pretrained loads them; fp32 weights under bf16 autocast; and the layouts FSDP2 trainers run:
the model sharded with fully_shard over FSDP_WORLD ranks before attach, under a bf16 param policy
or bf16 autocast), `check_family` builds a tiny model
from the config class with small overrides (no download), spreads its router weights so probes do
not tie, attaches replay outside any autocast (as a trainer does) and requires, in order:
  1. every router gets a registered or verified adapter (find_routers; a refusal is the reason), and
     verifies again on the first forward in the mode's dtype and autocast state;
  2. self-replay: replaying the routes HF itself chose in this batch's forward, in this mode, gives
     bit-identical outputs;
  3. replaying other routes (each id shifted by one expert) changes the outputs, so the MoE block
     really consumes the replayed ids (a block that re-routes on its own would pass 2 and fail here);
  4. a backward under replay: every gradient finite, every router's weight gradient non-zero.
A family that fails any step, or errors while being built, is listed with its reason, per mode.
The FSDP2 modes run in one spawn of FSDP_WORLD gloo ranks that loops over every family (`run_fsdp2`);
`fsdp2_replay_check` is the same check for one family in a process group the caller set up (a GPU's).

Legend: B batch rows, S tokens, T tokens of one sequence, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok", "moe_topk", "top_k_experts")
"""Config attributes that name experts (a default above 1 makes a model type an MoE family even without a router class)."""
_ROUTER_CLASS_RE = re.compile(r"^class (\w+(?:Router|Gating|Gate))\(", re.MULTILINE)
"""Router-shaped class definitions in a modeling module; a *Gate counts only where its body reads a top_k."""


@dataclass(frozen=True)
class Precision:
    """How a trainer runs the forward: the parameter dtype as loaded, the autocast dtype around the forward,
    and how the model is laid out (one process, or FSDP2-sharded with a mixed-precision param dtype)."""

    name: str
    weights: torch.dtype
    autocast: torch.dtype | None = None
    about: str = ""
    layout: Literal["single", "fsdp2"] = "single"
    """"fsdp2": fully_shard on each decoder layer and the root (verl's FSDP2 actor), before attach."""
    param_dtype: torch.dtype | None = None
    """FSDP2 MixedPrecisionPolicy(param_dtype=...): the dtype its forward gathers the stored weights in."""

    def __post_init__(self) -> None:
        if self.layout not in ("single", "fsdp2"):
            raise ValueError(f"Precision {self.name!r}: layout must be 'single' or 'fsdp2', got {self.layout!r}")
        if self.param_dtype is not None and self.layout != "fsdp2":
            raise ValueError(f"Precision {self.name!r}: param_dtype={self.param_dtype} needs layout 'fsdp2'")

    def forward(self, device_type: str = "cpu"):
        """The context of the forward only: backward runs outside it, as torch.autocast asks."""
        return torch.autocast(device_type, dtype=self.autocast) if self.autocast is not None else contextlib.nullcontext()


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", torch.float32, about="fp32 weights, no autocast"),
        Precision("bf16", torch.bfloat16, about="bf16 weights as `from_pretrained(dtype=torch.bfloat16)` loads them "
                  "(tensors the model keeps in fp32 stay fp32), no autocast"),
        Precision("autocast_bf16", torch.float32, torch.bfloat16,
                  about="fp32 weights, forward under `torch.autocast(dtype=torch.bfloat16)` (verl's and most FSDP trainers' forward)"),
        Precision("fsdp2_bf16", torch.float32, layout="fsdp2", param_dtype=torch.bfloat16,
                  about="FSDP2 over 2 gloo ranks (`fully_shard` on each decoder layer and the root, before attach), fp32 "
                  "weights stored, `MixedPrecisionPolicy(param_dtype=torch.bfloat16)`, no autocast"),
        Precision("fsdp2_autocast_bf16", torch.float32, torch.bfloat16, layout="fsdp2",
                  about="FSDP2 over 2 gloo ranks as above, fp32 weights (no param policy), forward under bf16 autocast"),
    )
}
"""The modes coverage is measured in, in table order."""

FSDP_WORLD = 2
"""Ranks of the FSDP2 modes: 2 is the least that really shards (each rank holds half of each router matrix)."""

LAYERS = 3
"""Decoder layers of the tiny models: with DeepSeek's first dense layer still 2 MoE layers."""
TINY: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, moe_topk=2,
    top_k_experts=2, n_shared_experts=1, shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    mlp_only_layers=[], decoder_sparse_step=1, sliding_window=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
)
"""Overrides applied to every config that has the attribute: 8 experts, top-2, width 64."""
FAMILY_TINY: dict[str, dict[str, Any]] = {
    "glm4v_moe_text": dict(head_dim=128),  # its default mrope sections [8, 12, 12] need a 64-wide rotary half
    "lfm2_moe": dict(layer_types=["full_attention", "conv", "full_attention"], num_dense_layers=1),
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse", "sparse"]),
    "granitemoehybrid": dict(layer_types=["attention", "linear_attention", "attention"]),
    "ernie4_5_vl_moe_text": dict(moe_intermediate_size=[32, 32]),
    "qwen3_omni_moe_talker_text": dict(shared_expert_intermediate_size=32),
    "zaya": dict(num_experts_per_tok=1),  # ZAYA validates top-1 only
    "dbrx": dict(d_model=64, n_heads=4, n_layers=LAYERS, max_seq_len=64, ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8,
                 moe_top_k=2, hidden_size=64), attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)),
    **{f: dict(enable_moe_block=True, global_head_dim=16, hidden_size_per_layer_input=16, vocab_size_per_layer_input=96,
               num_kv_shared_layers=0, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
       for f in ("gemma4_text", "diffusion_gemma_text")},  # MoE blocks are off by default
}
"""Per-family overrides on top of TINY, where a family's defaults do not shrink on their own."""

SEQ_LENS = (7, 5)
"""Two rows of different length: padding is part of what replay must line up."""


@dataclass
class FamilyResult:
    family: str
    status: str
    """"replayed", "refused" (by replay, at attach or on the first forward, before any replayed output) or
    "error" (failed elsewhere)."""
    precision: str = "fp32"
    """Name in PRECISIONS."""
    note: str = ""
    """How the mode was run where it differs from its definition (a model HF itself cannot run as loaded)."""
    rule: str = ""
    reason: str = ""
    router: str = ""
    model_class: str = ""
    seconds: float = 0.0
    layers: list[int] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in ("", [], None)}


def _router_classes(folder: str) -> list[str]:
    """Router-shaped classes defined in a model folder's modeling modules."""
    names = []
    for f in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not (f.startswith("modeling_") and f.endswith(".py")):
            continue
        src = open(os.path.join(folder, f)).read()
        for m in _ROUTER_CLASS_RE.finditer(src):
            body = src[m.end():].split("\nclass ", 1)[0]
            if not m.group(1).endswith("Gate") or "top_k" in body:
                names.append(m.group(1))
    return names


def moe_families() -> dict[str, tuple[str, str]]:
    """{text model type: (config class name, its module)} for every model type whose modeling module defines
    a router class and whose text config names experts (DBRX: in its ffn_config), or whose text config has more
    than one expert by default (inline routing)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    out: dict[str, tuple[str, str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        folder = os.path.join(root, model_type_to_module_name(model_type))
        routers = _router_classes(folder)
        sources = [os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("configuration_")] if os.path.isdir(folder) else []
        if not routers and not any(key in open(f).read() for f in sources for key in _EXPERT_KEYS):
            continue  # instantiating all ~450 configs costs a minute; only those with a router or naming experts can be MoE
        try:
            cfg = CONFIG_MAPPING[model_type]()
            text = cfg.get_text_config()
        except Exception:  # composite configs that need sub-configs or optional packages: not text MoE
            continue
        if routers and not any(_has(text, k) for k in _EXPERT_KEYS + ("ffn_config",)):
            continue  # a vision or audio config of a model whose text half routes
        if not routers:
            experts = [_get(text, k) for k in _EXPERT_KEYS]
            if not any(isinstance(v, int) and v > 1 for v in experts) and not isinstance(_get(text, "num_experts"), list):
                continue
        key = str(getattr(text, "model_type", "") or model_type)
        out.setdefault(key, (type(text).__name__, type(text).__module__))
    return dict(sorted(out.items()))


def _model_class(config_cls: type, config_module: str) -> type:
    """The causal LM for this config class, else its base text model, from the family's modeling module."""
    from transformers import PreTrainedModel

    modeling = importlib.import_module(config_module.replace(".configuration_", ".modeling_"))
    mine = [
        c for c in vars(modeling).values()
        if isinstance(c, type) and issubclass(c, PreTrainedModel) and getattr(c, "config_class", None) is config_cls
    ]
    for suffix in ("ForCausalLM", "Model"):
        for c in mine:
            if c.__name__.endswith(suffix) and "Pretrained" not in c.__name__ and "PreTrained" not in c.__name__:
                return c
    raise LookupError(f"no causal LM or base model class for {config_cls.__name__} in {modeling.__name__}")


def _has(config: Any, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # per-layer attributes (Gemma 4's head_dim) raise on a global read: they exist
        return True


def _get(config: Any, name: str) -> Any:
    try:
        return getattr(config, name, None)
    except Exception:  # a per-layer attribute (transformers 5.24's heterogeneous configs) raises on a global read
        return None


def tiny_config(family: str, config_cls: type) -> Any:
    base = config_cls()
    kwargs = {k: v for k, v in TINY.items() if _has(base, k)}
    if hasattr(base, "kv_lora_rank"):  # multi-head latent attention: rotary width is qk_rope_head_dim, kv heads = heads
        kwargs.update(head_dim=kwargs["qk_rope_head_dim"], num_key_value_heads=kwargs["num_attention_heads"])
    kwargs.update(FAMILY_TINY.get(family, {}))
    for list_key in ("layer_types", "mlp_layer_types"):
        default = getattr(base, list_key, None) if _has(base, list_key) and not isinstance(getattr(config_cls, list_key, None), property) else None
        if isinstance(getattr(config_cls, list_key, None), property):
            continue  # derived from other fields (Jamba)
        if isinstance(default, list) and len(default) >= LAYERS:
            kwargs.setdefault(list_key, list(default[-LAYERS:]))
    if isinstance(getattr(base, "num_experts", None), list):
        kwargs["num_experts"], kwargs["moe_topk"] = [8] * LAYERS, [2] * LAYERS
    return config_cls(**kwargs)


def _spread_routers(model: nn.Module) -> None:
    """Router matrices N(0, 0.5) and selection biases N(0, 0.3): no ties, and the bias changes choices."""
    from .infer import looks_like_router
    from .routers import adapter_for

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if adapter_for(module) is None and not looks_like_router(module):
                continue
            for name, p in list(module.named_parameters()) + list(module.named_buffers()):
                if p.is_floating_point() and p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                elif p.is_floating_point() and "bias" in name:
                    p.copy_(torch.randn(p.shape, generator=gen).view_as(p) * 0.3)


def cast_as_loaded(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` in `dtype` as `from_pretrained(dtype=dtype)` loads it: the tensors its dtype plan keeps in fp32
    (`_keep_in_fp32_modules_strict`, e.g. ERNIE-4.5's router weight and DeepSeek-V3's correction bias) stay fp32."""
    model = model.to(dtype)
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    keep = [re.compile(k.replace("*", ".*")) for k, v in plan.items() if v == torch.float32]
    if keep and dtype != torch.float32:
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and any(k.search(name) for k in keep):
                t.data = t.data.float()
    return model


def build_tiny(family: str, families: dict[str, tuple[str, str]] | None = None, dtype: torch.dtype = torch.float32,
               as_loaded: bool = True) -> nn.Module:
    """The family's tiny random model, router weights spread, in `dtype` as from_pretrained would load it
    (`as_loaded=False`: every tensor in `dtype`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    families = families or moe_families()
    cls_name, module = families[family]
    config_cls = getattr(importlib.import_module(module), cls_name)
    config = tiny_config(family, config_cls)
    torch.manual_seed(0)
    model = _model_class(config_cls, module)(config).float().eval()
    for parent in model.modules():  # selection biases that live on the MoE block, not the router
        for name, b in parent.named_buffers(recurse=False):
            if name in ("e_score_correction_bias", "expert_bias") and b.is_floating_point():
                with torch.no_grad():
                    b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    _spread_routers(model)
    return cast_as_loaded(model, dtype) if as_loaded else model.to(dtype)


def _traces(model: nn.Module, geometry) -> list:
    """Traces of HF's own free routes, each sequence run alone (as an engine would)."""
    from .replay import self_routed_trace

    rng = np.random.default_rng(0)
    return [self_routed_trace(model, rng.integers(3, geometry.vocab_size, s), 2, f"req-{i}")
            for i, s in enumerate(SEQ_LENS)]


def _shifted(traces: list, geometry) -> list:
    """The same sets moved by one expert: mostly experts HF would not pick."""
    from dataclasses import replace

    return [replace(t, routes_TLK=(t.routes_TLK + 1) % geometry.num_experts) for t in traces]


def _rule(site) -> str:
    """The rule verified for the forward the site's router ran in (the attach one before any forward)."""
    from .infer import forward_adapter

    adapter = forward_adapter(site.module) or site.adapter
    return adapter.describe()


def _own_forward_fails(model: nn.Module, mode: Precision) -> str | None:
    """Why HF's own forward (no replay) of one short sequence fails in `mode`, or None."""
    try:
        with torch.no_grad(), mode.forward():
            model(input_ids=torch.arange(3, 3 + SEQ_LENS[0]).view(1, -1))
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return None


def check_family(family: str, families: dict[str, tuple[str, str]] | None = None, precision: str = "fp32") -> FamilyResult:
    """Build, self-replay, shifted replay and backward one family in one precision mode; never raises."""
    from moe_replay.replay import build_plan
    from moe_replay.replay.errors import UnsupportedRouterError

    from .replay import model_geometry, output_tensor, replay, self_replay_gap
    from .routers import find_routers

    mode = PRECISIONS[precision]
    t0 = time.perf_counter()
    result = FamilyResult(family, "error", precision)
    try:
        model = build_tiny(family, families, mode.weights)
        result.model_class = type(model).__name__
        if mode.layout == "fsdp2":
            fsdp2_shard(model, mode.param_dtype)
            if mode.param_dtype is not None and (why := _own_forward_fails(model, mode)) is not None:
                plain = build_tiny(family, families, mode.weights)
                for b in plain.buffers():
                    if b.is_floating_point():
                        b.data = b.data.to(mode.param_dtype)
                fsdp2_shard(plain, mode.param_dtype)
                if _own_forward_fails(plain, mode) is None:  # the fp32 buffers are what breaks HF's forward
                    model = plain
                    result.note = (f"HF's own forward fails under FSDP2's param policy, which casts parameters, not buffers "
                                   f"({why}); measured with floating buffers in {str(mode.param_dtype).replace('torch.', '')}")
        elif mode.weights != torch.float32 and (why := _own_forward_fails(model, mode)) is not None:
            plain = build_tiny(family, families, mode.weights, as_loaded=False)
            if _own_forward_fails(plain, mode) is None:  # the tensors kept in fp32 are what breaks HF's forward
                model = plain
                result.note = (f"HF's own forward fails with the tensors from_pretrained keeps in fp32 ({why}); "
                               f"measured with every tensor in {str(mode.weights).replace('torch.', '')}")
    except Exception as e:
        result.reason = f"tiny model does not build: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return result
    try:
        sites = find_routers(model)  # attach outside autocast, as a trainer attaches
        first = next(iter(sites.values()))
        result.router = type(first.module).__name__
        result.layers = list(sites)
        result.rule = "; ".join(sorted({_rule(s) for s in sites.values()}))
        geometry = model_geometry(model, sites)
        traces = _traces(model, geometry)
        gap = self_replay_gap(model, traces, mode.forward)
        result.rule = "; ".join(sorted({_rule(s) for s in sites.values()}))
        if gap != 0.0:
            result.reason = f"self-replay differs from HF by {gap:.3g}"
            return result
        plan = build_plan(traces, geometry)
        with torch.no_grad(), mode.forward():
            ref = output_tensor(model(**plan.model_inputs()))
        mask_BS = plan.attention_mask_BS.bool()
        shifted = build_plan(_shifted(traces, geometry), geometry)
        model.zero_grad()
        with replay(model, shifted) as session:
            with mode.forward():
                out2 = output_tensor(model(**session.model_inputs()))
            out2[mask_BS].float().pow(2).mean().backward()
        if torch.equal(out2[mask_BS].detach(), ref[mask_BS]):
            result.reason = "replaying other experts leaves the outputs unchanged: the MoE block does not use the router's ids"
            return result
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        like = named[0][1] if named else None
        bad = [n for (n, _), b in zip(named, _any_ranks([not torch.isfinite(_local(g)).all() for _, g in named], like)) if b]
        if bad:
            result.reason = f"non-finite gradients in {bad[:3]}"
            return result
        router_grads = [next((p.grad for p in s.module.parameters() if p.dim() == 2), None) for s in sites.values()]
        moved = _any_ranks([g is not None and bool(_local(g).abs().sum() > 0) for g in router_grads], like)
        for (lid, site), grad, nonzero in zip(sites.items(), router_grads, moved):
            if grad is None or not nonzero:
                result.reason = f"router of layer {lid} ({site.name}) gets no gradient"
                return result
        result.status = "replayed"
    except UnsupportedRouterError as e:
        result.status, result.reason = "refused", str(e)
        if result.reason.startswith("no MoE router"):  # the registry listing says nothing about this family
            result.reason = "no router module: the MoE block computes its routing inline, so there is no router output to replace"
    except Exception as e:
        result.reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        result.seconds = round(time.perf_counter() - t0, 2)
    return result


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of an FSDP2 shard, else `t`."""
    from .fsdp import is_sharded

    return t.to_local() if is_sharded(t) else t


def _any_ranks(flags: list[bool], like: torch.Tensor | None) -> list[bool]:
    """Each flag OR-ed over the ranks that shard `like` (one all-reduce on its mesh's group and device), or as
    given where `like` is no shard."""
    from .fsdp import is_sharded

    if not flags or not is_sharded(like):
        return [bool(f) for f in flags]
    import torch.distributed as dist

    t = torch.tensor([float(bool(f)) for f in flags], device=like.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=like.device_mesh.get_group())
    return [bool(v) for v in t.tolist()]


def fsdp2_shard(model: nn.Module, param_dtype: torch.dtype | None = None, mesh: Any = None) -> nn.Module:
    """`model` sharded as verl's FSDP2 actor shards it: `fully_shard` on each decoder layer, then on the root,
    with `MixedPrecisionPolicy(param_dtype=param_dtype)`, over `mesh` (default: every rank of the default
    process group, on the device the model's parameters are on). Needs an initialised process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .routers import _LAYER_LISTS, _decoder_layers_prefix

    if mesh is None:
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    prefix = _decoder_layers_prefix(model)
    modules = dict(model.named_modules())
    layers = modules.get(prefix[:-1]) if prefix else next(
        (m for n, m in modules.items() if isinstance(m, nn.ModuleList) and n.rsplit(".", 1)[-1] in _LAYER_LISTS), None)
    for layer in layers or []:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def run_all(families: dict[str, tuple[str, str]] | None = None, precisions: list[str] | None = None,
            threads: int = 1) -> dict[str, list[FamilyResult]]:
    """{precision: check_family over every MoE family}; one torch thread (tiny matmuls drown in threading on a shared
    CPU). The FSDP2 modes run together in one spawn of FSDP_WORLD ranks (run_fsdp2)."""
    families = families or moe_families()
    modes = precisions or list(PRECISIONS)
    sharded = [p for p in modes if PRECISIONS[p].layout == "fsdp2"]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {p: [check_family(f, families, p) for f in families] for p in modes if p not in sharded}
    finally:
        torch.set_num_threads(before)
    if sharded:
        out.update(run_fsdp2(families, sharded, threads))
    return {p: out[p] for p in modes}


FSDP_TIMEOUT_S = 300
"""Gloo's collective timeout in the coverage ranks: a family whose ranks stop agreeing fails in 5 min, not never."""


def _fsdp2_rank(rank: int, world: int, port: int, families: dict[str, tuple[str, str]], modes: list[str], threads: int,
                out_dir: str) -> None:
    """One rank of run_fsdp2: every family in every FSDP2 mode, results pickled to out_dir/rank<r>.pkl."""
    import datetime
    import pickle
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=FSDP_TIMEOUT_S))
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        out = {p: [check_family(f, families, p) for f in families] for p in modes}
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


def run_fsdp2(families: dict[str, tuple[str, str]], modes: list[str], threads: int = 1,
              world: int = FSDP_WORLD) -> dict[str, list[FamilyResult]]:
    """{mode: check_family over `families`} for FSDP2 modes, in one spawn of `world` gloo ranks on this CPU that
    loops over every family (one spawn, not one per family: a spawn costs ~10 s of imports). Each rank checks
    the same model on the same batch; a family whose ranks disagree is an error naming both answers."""
    import pickle
    import socket
    import tempfile

    import torch.multiprocessing as mp

    bad = [m for m in modes if PRECISIONS[m].layout != "fsdp2"]
    if bad:
        raise ValueError(f"run_fsdp2 runs FSDP2 modes only, got {bad}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_fsdp2_rank, args=(world, port, dict(families), list(modes), threads, out_dir), nprocs=world)
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                ranks.append(pickle.load(f))
    out = ranks[0]
    for mode, results in out.items():
        for i, r in enumerate(results):
            others = [rk[mode][i] for rk in ranks[1:] if (rk[mode][i].status, rk[mode][i].rule) != (r.status, r.rule)]
            if others:
                results[i] = FamilyResult(r.family, "error", mode, reason=f"ranks disagree: rank 0 {r.status} ({r.rule}), "
                                          f"another {others[0].status} ({others[0].rule}): {others[0].reason}")
    return out


def fsdp2_replay_check(family: str, device: str | torch.device = "cuda", dtype_mode: str = "fsdp2_bf16",
                       families: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """One family's tiny model on `device`, FSDP2-sharded over the default process group (initialised by the
    caller: NCCL on a GPU, gloo on CPU; any world size), replay attached after sharding, in the FSDP2 mode
    `dtype_mode` (a PRECISIONS name with layout "fsdp2"). Replays the routes the model chose itself in the same
    batch and compares with its own forward. Returns {family, mode, device, world_size, rule, bit_identical,
    max_abs_logit_diff, flips, routed_positions, flips_vs_alone, refused}: `flips` are replayed positions whose
    expert set differs from the model's own choice under replay (0 where replay lands every route where it
    belongs); `flips_vs_alone` the same against routes recorded with each sequence run alone (as an engine
    runs it: batch padding may change bf16 rounding); `refused` the UnsupportedRouterError's text, or None.
    Every rank must call it with the same arguments (the FSDP2 gathers are collectives)."""
    import torch.distributed as dist

    from moe_replay.replay import build_plan
    from moe_replay.replay.errors import UnsupportedRouterError

    from .replay import capture_routes, model_geometry, output_tensor, replay, with_own_routes
    from .routers import find_routers

    mode = PRECISIONS[dtype_mode]
    if mode.layout != "fsdp2":
        raise ValueError(f"dtype_mode {dtype_mode!r} is not an FSDP2 mode; FSDP2 modes: "
                         f"{[p for p, m in PRECISIONS.items() if m.layout == 'fsdp2']}")
    if not dist.is_initialized():
        raise RuntimeError("fsdp2_replay_check needs an initialised default process group (torch.distributed.init_process_group)")
    device = torch.device(device)
    families = families or moe_families()
    model = build_tiny(family, families, mode.weights).to(device)
    fsdp2_shard(model, mode.param_dtype)
    out: dict[str, Any] = dict(family=family, mode=dtype_mode, device=str(device), world_size=dist.get_world_size(),
                               rule="", bit_identical=False, max_abs_logit_diff=float("nan"), flips=None,
                               routed_positions=None, flips_vs_alone=None, refused=None)
    try:
        sites = find_routers(model)
        geometry = model_geometry(model, sites)
        traces = _traces(model, geometry)
        plan = build_plan(traces, geometry).to(device)
        with torch.no_grad(), mode.forward(device.type), capture_routes(model) as own:
            ref = output_tensor(model(**plan.model_inputs()))
        mask_BS = plan.attention_mask_BS.bool()
        for name, p in (("flips", with_own_routes(plan, own)), ("flips_vs_alone", plan)):
            with torch.no_grad(), mode.forward(device.type), replay(model, p, track_flips=True) as session:
                got = output_tensor(model(**session.model_inputs()))
            out[name] = int(sum(session.flips.flips.values()))
            if name == "flips":
                out["routed_positions"] = int(sum(session.flips.positions.values()))
                diff = (got[mask_BS].float() - ref[mask_BS].float()).abs().max().item()
                out["max_abs_logit_diff"] = diff
                out["bit_identical"] = bool(torch.equal(got[mask_BS], ref[mask_BS]))
        out["rule"] = "; ".join(sorted({_rule(s) for s in sites.values()}))
    except UnsupportedRouterError as e:
        out["refused"] = str(e)
    return out



def summary(results: dict[str, list[FamilyResult]]) -> dict[str, Any]:
    """The JSON the coverage script prints: counts per precision mode, then each mode's refusals and replays."""
    import transformers

    return {
        "transformers": transformers.__version__,
        "families_total": {p: len(rs) for p, rs in results.items()},
        "families_replayed": {p: sum(r.status == "replayed" for r in rs) for p, rs in results.items()},
        "seconds": {p: round(sum(r.seconds for r in rs), 1) for p, rs in results.items()},
        "modes": {
            p: {
                "about": PRECISIONS[p].about,
                "families_refused": {r.family: r.reason for r in rs if r.status != "replayed"},
                "notes": {r.family: r.note for r in rs if r.note},
                "replayed": sorted(r.family for r in rs if r.status == "replayed"),
            }
            for p, rs in results.items()
        },
    }


TABLE_HEAD = "| family | config class | mode | model built | router | rule (verified) | status | reason |"


def markdown(results: dict[str, list[FamilyResult]], families: dict[str, tuple[str, str]]) -> str:
    """docs/hf_coverage.md: counts per mode, then one row per family and mode, the table the tests read back
    (family, config class and mode identify what to rebuild)."""
    import transformers

    s = summary(results)
    modes = list(results)
    lines = [
        "# HF transformers MoE coverage (generated)",
        "",
        f"Generated by `python benchmarks/hf_coverage.py --write` on transformers {transformers.__version__}. Do not edit by hand.",
        "",
        "| mode | what runs | families replayed |",
        "|---|---|---|",
        *[f"| {p} | {PRECISIONS[p].about} | {s['families_replayed'][p]} of {s['families_total'][p]} |" for p in modes],
        "",
        "A family is *replayed* in a mode when, on a tiny random model built from its config class (3 layers, 8 experts, "
        "top-2, width 64, no download) and run in that mode, every router gets a registered or a verified inferred "
        "gate rule (checked at attach, outside autocast, and again on the first forward in the mode's dtype and "
        "autocast state), replaying the routes HF chose in the same forward gives bit-identical outputs, replaying "
        "other experts changes them, and a backward under replay is finite with a non-zero gradient on every router. "
        "*refused* is replay refusing the model by name before any replayed output (at attach or on the first "
        "forward of a mode); *error* is the tiny model failing elsewhere (building, running). "
        "Where HF's own forward fails with the tensors "
        "from_pretrained keeps in fp32, the bf16 row is measured with every tensor in bf16 and says so.",
        "",
        f"The `fsdp2_*` modes are the layout FSDP2 trainers (verl's FSDP2 actor) run: the same tiny model sharded with "
        f"`fully_shard` on each decoder layer and the root over {FSDP_WORLD} gloo ranks (each rank holds a shard of each "
        "router matrix) *before* replay attaches. Attach gathers each router's parameters with its FSDP2 module's own "
        "`unshard()`, so the rule is verified on the parameters in the dtype the forward gathers them in (bf16 under the "
        "param policy); each rank runs the same batch, and a family whose ranks disagree is an error. Where HF's own "
        "forward fails under the param policy (FSDP2 casts parameters, not buffers), the row is measured with floating "
        "buffers in bf16 and says so.",
        "",
        "What the tests re-run: `tests/test_hf_coverage.py` every row replayed in fp32, and the bf16 and autocast_bf16 "
        "rows of (a) every family whose verified rule differs between this table's modes, read from this table, and "
        "(b) the families its `PRECISION_SENSITIVE` lists, whose arithmetic depends on the precision without changing "
        "the rule's name (router weights kept in fp32, weights cast to the input dtype, bf16 logits that tie outside "
        "the top k); the other families' bf16 rows are not re-run (their rule and its arithmetic are the fp32 ones). "
        "`tests/test_hf_fsdp.py` re-runs the fsdp2 rows of the same families, and of mellum (an inferred rule the "
        "precision does not change) and deepseek_v3 (a registered one); all its tests are marked slow (2 ranks).",
        "",
        "Families are the model types whose modeling module defines a router class (`*Router`, `*Gating`, or a "
        "`*Gate` reading a top_k), and those whose config has more than one expert by default (inline routing).",
        "",
        "Rule notation: `softmax_topk` softmax over all experts then gather; `topk_softmax` softmax over the "
        "top-k logits; `sigmoid_bias_group` per-expert score (sigmoid or sqrtsoftplus) then gather; `renorm` "
        "divide by the K-sum (`eps` added); `scale` a multiplier; `bias` a selection-only bias; `groups=G/k` "
        "group-limited selection; `logits-dtype` scores computed in the logits' own dtype (bf16 where the router's "
        "linear returns bf16) rather than in fp32.",
        "",
        TABLE_HEAD,
        "|---|---|---|---|---|---|---|---|",
    ]
    by_family: dict[str, dict[str, FamilyResult]] = {}
    for p in modes:
        for r in results[p]:
            by_family.setdefault(r.family, {})[p] = r
    for family in sorted(by_family):
        cls_name, module = families[family]
        for p in modes:
            r = by_family[family].get(p)
            if r is None:
                continue
            reason = "; ".join(x for x in (r.reason, r.note) if x).replace("|", "/").replace("\n", " ")
            lines.append(f"| {family} | `{module}.{cls_name}` | {p} | {r.model_class} | {r.router} | {r.rule} | {r.status} | {reason} |")
    return "\n".join(lines) + "\n"


def _rows(path: str) -> list[list[str]]:
    """The family rows of a generated table, as their 8 cells (TABLE_HEAD's columns)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in open(path)]
    return [r for r in rows if len(r) == 8 and r[0] not in ("family", "---")]


def read_table(path: str) -> dict[str, list[FamilyResult]]:
    """{mode: results} as a generated table holds them (a row's note stays inside its reason; seconds are not kept),
    so `markdown` renders the same table: what `benchmarks/hf_coverage.py --update` re-runs some rows of."""
    out: dict[str, list[FamilyResult]] = {p: [] for p in PRECISIONS}
    for family, _, mode, model_class, router, rule, status, reason in _rows(path):
        if mode not in out:
            raise ValueError(f"{path}: row of {family!r} in mode {mode!r}, not one of {list(PRECISIONS)}")
        layers: list[int] = []
        out[mode].append(FamilyResult(family, status, mode, "", rule, reason, router, model_class, 0.0, layers))
    return {p: rs for p, rs in out.items() if rs}


def claimed(path: str, precision: str = "fp32") -> dict[str, tuple[str, str]]:
    """{family: (config class name, module)} of the rows a generated table marks replayed in `precision`."""
    out: dict[str, tuple[str, str]] = {}
    for cells in _rows(path):
        if cells[2] == precision and cells[6] == "replayed":
            module, _, cls_name = cells[1].strip("`").rpartition(".")
            out[cells[0]] = (cls_name, module)
    return out


def mode_dependent(path: str) -> list[str]:
    """Families a generated table marks replayed in some modes under different verified rules (`logits-dtype` under
    autocast, say): those whose rule changes with the mode."""
    rules: dict[str, set[str]] = {}
    for cells in _rows(path):
        if cells[6] == "replayed":
            rules.setdefault(cells[0], set()).add(cells[5])
    return sorted(f for f, r in rules.items() if len(r) > 1)
