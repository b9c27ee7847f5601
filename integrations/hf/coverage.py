"""Which MoE families of the installed transformers replay, per precision mode, measured on tiny random models.

Families: tiny.moe_families (the decoder MoE families of the installed transformers). For each, in each
mode (PRECISIONS: fp32; bf16 weights as from_pretrained loads them; fp32 weights under bf16 autocast; and
the layouts FSDP2 trainers run: the model sharded with fully_shard over FSDP_WORLD ranks before attach,
under a bf16 param policy or bf16 autocast), `check_family` builds its tiny model (tiny.build_tiny: small
overrides on the config class, no download, router weights spread so probes do not tie), attaches replay
outside any autocast (as a trainer does) and requires, in order:
  1. every router gets a registered or verified adapter (find_routers; a refusal is the reason), and
     verifies again on the first forward in the mode's dtype and autocast state;
  2. self-replay: replaying the routes HF itself chose in this batch's forward, in this mode, gives
     bit-identical outputs;
  3. replaying other routes (each id shifted by one expert) changes the outputs, so the MoE block
     really consumes the replayed ids (a block that re-routes on its own would pass 2 and fail here);
  4. a backward under replay: every gradient finite, every router's weight gradient non-zero.
A family that fails any step is listed with its reason and status, per mode: "refused" where replay refuses
it by name, "builder" where its tiny model does not build or HF's own fp32 forward of it fails with no replay
attached (the builder's failure, not the family's), "error" for anything else.
The FSDP2 modes run in one spawn of FSDP_WORLD gloo ranks that loops over every family (`run_fsdp2`);
`fsdp2_replay_check` is the same check for one family in a process group the caller set up (a GPU's).

Legend: B batch rows, S tokens, T tokens of one sequence, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from .tiny import (  # noqa: F401  (re-exported: tests and benchmarks import them from coverage)
    FAMILY_TINY, LAYERS, TINY, TinyBuildError, _get, _has, _model_class, _router_classes, _spread_routers, build_tiny,
    cast_as_loaded, moe_families, tiny_config,
)

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

SEQ_LENS = (7, 5)
"""Two rows of different length: padding is part of what replay must line up."""


@dataclass
class FamilyResult:
    family: str
    status: str
    """"replayed", "refused" (by replay, at attach or on the first forward, before any replayed output),
    "builder" (the tiny model could not be built, or HF's own forward of it fails in fp32: the builder's failure,
    not the family's) or "error" (failed elsewhere)."""
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


def _notes(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


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
        notes: list[str] = []
        model = build_tiny(family, families, mode.weights, notes=notes)
        result.model_class, result.note = type(model).__name__, _notes(*notes)
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
                    result.note = _notes(result.note, f"HF's own forward fails under FSDP2's param policy, which casts "
                                         f"parameters, not buffers ({why}); measured with floating buffers in "
                                         f"{str(mode.param_dtype).replace('torch.', '')}")
        elif mode.weights != torch.float32 and (why := _own_forward_fails(model, mode)) is not None:
            plain = build_tiny(family, families, mode.weights, as_loaded=False)
            if _own_forward_fails(plain, mode) is None:  # the tensors kept in fp32 are what breaks HF's forward
                model = plain
                result.note = _notes(result.note, f"HF's own forward fails with the tensors from_pretrained keeps in fp32 "
                                     f"({why}); measured with every tensor in {str(mode.weights).replace('torch.', '')}")
    except TinyBuildError as e:
        result.status, result.reason = "builder", str(e).removeprefix(f"{family}: ")
        return result
    except Exception as e:
        result.reason = f"tiny model does not build: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return result
    try:
        sites = find_routers(model)  # attach outside autocast, as a trainer attaches; a refusal here is the family's
        if (why := _own_forward_fails(model, mode)) is not None:
            fp32 = PRECISIONS["fp32"]
            if mode is fp32 or _own_forward_fails(build_tiny(family, families), fp32) is not None:
                result.status = "builder"
                result.reason = f"tiny model does not run (HF's own forward, no replay attached): {why}"
            else:
                result.reason = f"HF's own forward fails in this mode, no replay attached (it runs in fp32): {why}"
            return result
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
        elif (mode is not PRECISIONS["fp32"] and (why := _own_forward_fails(model, mode)) is not None
              and _own_forward_fails(build_tiny(family, families), PRECISIONS["fp32"]) is None):
            # attach probes the router as HF's forward runs it: where HF's own forward fails in this mode only (a
            # router casting its input to fp32 against bf16 parameters), the refusal is HF's failure, not replay's
            result.status, result.router, result.rule = "error", "", ""
            result.reason = f"HF's own forward fails in this mode, no replay attached (it runs in fp32): {why}"
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
    leave_dtensor_rank()


def leave_dtensor_rank() -> None:
    """End a spawned rank that ran DTensor (FSDP2) collectives, once its results are written and its process
    group destroyed, without interpreter finalization. torch 2.13 leaks Python references to the group from
    DTensor's collectives (10 after one `distribute_tensor` over 2 gloo ranks), so `destroy_process_group` leaves
    the gloo group alive with its three worker threads, and finalization tearing it down aborted a rank
    ("terminate called without an active exception", SIGABRT after the rank function had returned) in 6 runs
    of 24 of run_fsdp2 on a 2-core machine. Call it only on the success path: an exception must still reach
    mp.spawn with its traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    """The JSON the coverage script prints: counts per precision mode (each STATUSES status), then each mode's
    refusals (replay's, by name), builder failures, errors and replays."""
    import transformers

    return {
        "transformers": transformers.__version__,
        "families_total": {p: len(rs) for p, rs in results.items()},
        "families_replayed": {p: sum(r.status == "replayed" for r in rs) for p, rs in results.items()},
        "families_by_status": {p: {st: sum(r.status == st for r in rs) for st in STATUSES} for p, rs in results.items()},
        "seconds": {p: round(sum(r.seconds for r in rs), 1) for p, rs in results.items()},
        "modes": {
            p: {
                "about": PRECISIONS[p].about,
                "families_refused": {r.family: r.reason for r in rs if r.status == "refused"},
                "families_builder": {r.family: r.reason for r in rs if r.status == "builder"},
                "families_error": {r.family: r.reason for r in rs if r.status == "error"},
                "notes": {r.family: r.note for r in rs if r.note},
                "replayed": sorted(r.family for r in rs if r.status == "replayed"),
            }
            for p, rs in results.items()
        },
    }


STATUSES = ("replayed", "refused", "builder", "error")
"""FamilyResult.status values, in table order."""
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
        "| mode | what runs | families replayed | refused | builder | error |",
        "|---|---|---|---|---|---|",
        *[f"| {p} | {PRECISIONS[p].about} | {s['families_replayed'][p]} of {s['families_total'][p]} | "
          + " | ".join(str(s["families_by_status"][p][st]) for st in STATUSES[1:]) + " |" for p in modes],
        "",
        "A family is *replayed* in a mode when, on a tiny random model built from its config class (3 layers, 8 experts, "
        "top-2, width 64, no download) and run in that mode, every router gets a registered or a verified inferred "
        "gate rule (checked at attach, outside autocast, and again on the first forward in the mode's dtype and "
        "autocast state), replaying the routes HF chose in the same forward gives bit-identical outputs, replaying "
        "other experts changes them, and a backward under replay is finite with a non-zero gradient on every router. "
        "*refused* is replay refusing the model by name before any replayed output (at attach or on the first "
        "forward of a mode), for a reason of the family's own structure (an encoder-decoder model, an MoE block that "
        "routes inline, expert sets a token takes one of by its token type) or of its router (no rule reproduces its weights, an output replay "
        "cannot read); *builder* is the tiny model failing to build, or HF's own fp32 forward of it failing with no "
        "replay attached: the builder's failure, not the family's; *error* is anything else failing (HF's own forward "
        "in one mode only, a replay step). "
        "Where HF's own forward fails with the tensors "
        "from_pretrained keeps in fp32, the bf16 row is measured with every tensor in bf16 and says so. "
        "A family whose decoder layers each route every token through R > 1 routers (JetMoE: its attention's mixture "
        "of heads and its MLP, R = 2) is replayed at every router, each its own route layer (decoder layer * R + slot, "
        "docs/trace.md), and every step above covers each of them.",
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
        "`*Gate` reading a top_k), and those whose config has more than one expert by default (inline routing); "
        "not the sub-configs of vision or audio encoders (their experts route image patches or audio frames, never "
        "the decoder's tokens a trace records), nor model types transformers ships a config for but no modeling "
        "module (no model to run). Where the tiny model departs from HF's own construction (a tensor HF's init "
        "leaves unwritten, an input embedding HF's forward cannot find), its row's reason says so.",
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
