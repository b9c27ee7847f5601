"""The alignment audit: does it name every injected fault, stay silent on correct routes, and cost one forward?

On tiny HF models of several families (qwen3_moe, mixtral, olmoe, deepseek_v3 with a dense first layer,
qwen3_moe with 128 experts top-8; router weights spread wide, the project's default, or narrow: many
near-ties), 16 samples of corpus text each:

  1. calibration (`calibration`): correct routes recorded by an engine, in fp32 and in bf16, audited against
     the trainer's batched forward in fp32 and in bf16. Two engines: HF itself, each sample run alone (as an
     engine batches it), and vLLM-CPU (`--engines vllm`: moe_replay's capture of real rollouts, the first
     half of each text as the prompt; deepseek_v3 is left out there: vLLM-CPU's fused rotary op mis-rotates
     its MLA, docs/engine_coverage.md). Per pair: the least agreement per sample, per layer, per window of
     rows and per cell, and the exact-set flip rate (how many near-ties the precision change moved). These
     are the measurements `moe_replay/audit/thresholds.py` cites;
  2. `false_alarms`: misaligned samples the audit reported on those correct batches, per family, precision
     pair and format (target 0);
  3. `faults`: every fault of moe_replay/audit/zoo.py in every format it exists in, per family (the edges'
     faults, wrapped and out-of-range ids and GRPO siblings among them): `detected` (not ALIGNED), `named_cause`
     (the verdict's cause), `correct` (the expected one) and the evidence's figures (target: every fault detected
     and named); `by_routing_rule`: per routing rule (softmax top-k, with a shared expert, sigmoid + bias grouped
     top-k) the faults `detected` and `named_cause` (correctly) and the `false_alarms` on its correct batches;
  4. `cost`: the audit (one forward without gradients plus its comparison) against a plain no-grad forward
     of the same batch, in a fresh interpreter (after vLLM ran in a process, its forwards there are slower), on
     the `bench` qwen3_moe (8 MoE layers, hidden 512, 32 experts top-4), one thread,
     interleaved rounds: the median of the per-round ratios of wall time and of the process's CPU time (the
     latter steadier on a shared machine; target <= 1.1).

Usage: python benchmarks/audit.py --json [--families qwen3_moe,mixtral] [--samples 16] [--tokens 64]
       [--engines hf,vllm] [--cost-batch 8] [--cost-tokens 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import moe_replay  # noqa: E402
from moe_replay.audit import THRESHOLDS  # noqa: E402
from moe_replay.audit.zoo import FAULTS, Sample, inject, write  # noqa: E402

FAMILIES = {
    # name: (family recipe, config overrides, router logit std of the init)
    "qwen3_moe": ("qwen3_moe", {}, 2.5),
    "mixtral": ("mixtral", {}, 2.5),
    "olmoe_near_ties": ("olmoe", {}, 0.25),
    "deepseek_v3": ("deepseek_v3", {}, 2.5),
    "qwen3_moe_128x8": ("qwen3_moe", {"num_experts": 128, "num_experts_per_tok": 8}, 0.25),
    "qwen3_moe_64x8_near_ties": ("qwen3_moe", {"num_experts": 64, "num_experts_per_tok": 8}, 0.1),
    # held out of the first calibration: a bias-dominated grouped router, a shared-expert softmax,
    # and more experts than a uint8 holds
    "glm4_moe_16x4_narrow": ("glm4_moe", {"n_routed_experts": 16, "num_experts_per_tok": 4}, 0.1),
    "qwen2_moe_16x4": ("qwen2_moe", {"num_experts": 16, "num_experts_per_tok": 4}, 2.5),
    "qwen3_moe_512x8": ("qwen3_moe", {"num_experts": 512, "num_experts_per_tok": 8}, 0.25),
}
ROUTING_RULES = {
    "qwen3_moe": "softmax_topk_renorm", "mixtral": "softmax_topk_renorm", "olmoe": "softmax_topk",
    "qwen2_moe": "softmax_topk_shared_expert", "deepseek_v3": "sigmoid_bias_grouped_topk",
    "glm4_moe": "sigmoid_bias_grouped_topk",
}
"""The routing rule of each family recipe: what `by_routing_rule` groups the results by."""
FORMATS = ("trace", "vllm", "sglang", "verl", "megatron")
VLLM_SKIPS = {"deepseek_v3": "vLLM-CPU's fused rotary op mis-rotates MLA's strided q/k (logprobs drift by nats)"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EVERY_ROW = ("shift_forward", "shift_back", "other_sample", "layers_swapped", "batch_first", "other_weights", "random")
"""Faults that move every row of every sample: their samples' agreement is what `aligned` must sit above."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _samples(model, tokens: list[np.ndarray]) -> list[Sample]:
    """Each sample's routes as an engine records them: the sample run alone."""
    from moe_replay.integrations.hf import self_routed_trace

    return [Sample(f"s{b}", t, self_routed_trace(model, t, 4).routes_TLK.astype(np.int64)) for b, t in enumerate(tokens)]


def _texts(tok, samples: int, tokens: int) -> list[np.ndarray]:
    from moe_replay.models.corpus import corpus_lines

    lines = list(corpus_lines(seed=7, n_lines=samples * 8))
    return [np.array(sum((tok(x)["input_ids"] for x in lines[b * 8: b * 8 + 8]), [])[:tokens]) for b in range(samples)]


def _figures(ev) -> dict:
    out = {}
    for k, v in dataclasses.asdict(ev).items():
        if isinstance(v, float):
            out[k] = round(v, 4)
        elif isinstance(v, (list, tuple)):
            out[k] = json.loads(json.dumps(v[:8]))
        else:
            out[k] = v
    return out


def _vllm_samples(path: Path, texts: list[np.ndarray], dtype: str) -> list[Sample]:
    """Real rollouts of vLLM-CPU in `dtype`, captured by moe_replay: the first half of each text as the
    prompt, as many tokens generated (top_p 0.9); each trace's tokens and routes."""
    from vllm import LLM, SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture, capture_engine_kwargs

    llm = LLM(**capture_engine_kwargs(model=str(path), dtype=dtype, enforce_eager=True, max_model_len=512, max_num_seqs=8,
                                      max_num_batched_tokens=512, seed=0, distributed_executor_backend="uni"))
    try:
        cap = VllmCapture(llm, CaptureConfig(support=False))
        half = [t[: len(t) // 2] for t in texts]
        sps = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=len(t) - len(h), ignore_eos=True, seed=b)
               for b, (t, h) in enumerate(zip(texts, half))]
        _, traces = cap.generate([{"prompt_token_ids": h.tolist()} for h in half], sps)
        cap.uninstall()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return [Sample(f"v{b}", t.token_ids_S, t.routes_TLK.astype(np.int64)) for b, t in enumerate(traces)]


def run_family(name: str, root: Path, n_samples: int, n_tokens: int, engines: list[str]) -> tuple[dict, list, list]:
    from transformers import AutoTokenizer

    from moe_replay.integrations.hf import find_routers, model_geometry
    from moe_replay.models import InitSpec, build_tiny_model

    family, overrides, std = FAMILIES[name]
    path = build_tiny_model(family, root / name, init=InitSpec(router_logit_std=std), **overrides)
    tok = AutoTokenizer.from_pretrained(path)
    texts = _texts(tok, n_samples, n_tokens)
    models = {p: _load(path, DTYPES[p]) for p in DTYPES}
    g = model_geometry(models["fp32"])
    routes = {("hf", p): _samples(models[p], texts) for p in DTYPES}
    if "vllm" in engines and family not in VLLM_SKIPS:
        for p, vllm_dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
            routes[("vllm", p)] = _vllm_samples(path, texts, vllm_dtype)
    moved = _load(path, torch.float32)
    with torch.no_grad():
        for site in find_routers(moved).values():  # the router's weights by half their spread, a choosing bias by a fifth
            for w, by in [(site.module.weight, 0.5)] + [(b, 0.2) for n, b in site.module.named_buffers() if n.endswith("bias")]:
                w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * w.std() * by)
    other = _samples(moved, texts)
    half = n_tokens // 2  # GRPO siblings: each text's first half (the prompt) with the next text's second half
    siblings = _samples(models["fp32"], [np.concatenate([t[:half], texts[(b + 1) % len(texts)][half: len(t)]])
                                         for b, t in enumerate(texts)])

    calibration, alarms, faults = {}, [], []
    for (engine, rec), samples in routes.items():
        for fwd in DTYPES:
            worst = None
            for fmt in FORMATS:
                r, ids, kw = write(samples, fmt, g)
                report = moe_replay.audit(models[fwd], r, ids, format=fmt, **kw)
                alarms.append({"family": name, "routing_rule": ROUTING_RULES[family], "engine": engine, "routes": rec, "forward": fwd, "format": fmt,
                               "samples": len(report.samples), "false_alarms": len(report.misaligned)})
                worst = worst or _worst(report)
            own = _samples(models[fwd], [s.token_ids_S for s in samples])
            flips = np.mean([np.mean(np.sort(a.routes_TLK, -1) != np.sort(b.routes_TLK, -1)) for a, b in zip(samples, own)])
            cal = {f"min_{k}": round(v, 4) for k, v in worst.items() if k != "neighbour"}
            calibration[f"{engine}_{rec}_routes_{fwd}_forward"] = {**cal, "max_neighbour_gain": round(-worst["neighbour"], 4),
                                                                   "set_flip_rate": round(float(flips), 4)}
    for fault in FAULTS.values():
        if (fault.needs_dense and g.num_moe_layers == g.num_layers) or g.num_experts <= fault.min_experts:
            continue
        for fmt in fault.formats:
            r, ids, kw = inject(fault, routes[("hf", "fp32")], fmt, g, other=other, siblings=siblings)
            report = moe_replay.audit(models["fp32"], r, ids, format=fmt, **kw)
            faults.append({"family": name, "routing_rule": ROUTING_RULES[family], "fault": fault.name, "format": fmt, "expected": fault.cause.value,
                           "detected": not report.ok, "named_cause": report.verdict.cause.value,
                           "correct": report.verdict.cause is fault.cause,
                           "max_sample_agreement": round(max(s.agreement for s in report.samples), 4),
                           "max_neighbour_gain": round(max(s.neighbour for s in report.samples), 4),
                           "evidence": _figures(report.verdict.evidence)})
    return calibration, alarms, faults


def _worst(report) -> dict:
    return {"sample": min(s.agreement for s in report.samples), "layer": min(report.layer_agreement),
            "window": min(s.window for s in report.samples), "cell": float(np.nanmin(report.cells_BL)),
            "neighbour": -max(s.neighbour for s in report.samples)}


def cost(root: Path, batch: int, tokens: int, repeats: int, size: str = "bench") -> dict:
    """Audit vs a plain no-grad forward of the same batch, interleaved, on the qwen3_moe of `size`."""
    from transformers import AutoTokenizer

    from moe_replay.audit.free import token_batch
    from moe_replay.integrations.hf import model_geometry
    from moe_replay.models import build_tiny_model

    path = build_tiny_model("qwen3_moe", root / f"cost-{size}", size=size)
    model = _load(path, torch.float32)
    texts = _texts(AutoTokenizer.from_pretrained(path), batch, tokens)
    samples = _samples(model, texts)
    traces, _, _ = write(samples, "trace", model_geometry(model))
    inputs = token_batch([s.token_ids_S for s in samples], model_geometry(model)).model_inputs()

    def plain() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            model(**inputs, use_cache=False)
        return time.perf_counter() - t0, time.process_time() - c0

    def audited() -> tuple[float, float, float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        report = moe_replay.audit(model, traces)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert report.ok, report.summary()
        return wall, cpu, report.forward_s, report.analysis_s

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a shared 2-core machine's other load moves wall times by 2-5x
    try:
        plain(), audited()  # warm-up
        rows = []
        for r in range(repeats):
            if r % 2:
                a, p = audited(), plain()
            else:
                p, a = plain(), audited()
            rows.append((p, a))
    finally:
        torch.set_num_threads(threads)
    wall = [a[0] / p[0] for p, a in rows]
    cpu = [a[1] / p[1] for p, a in rows]
    g = model_geometry(model)
    med = statistics.median
    return {"model": f"qwen3_moe {size} ({g.num_moe_layers} MoE layers, {g.num_experts} experts top-{g.top_k})",
            "batch": batch, "tokens": tokens, "rounds": repeats, "threads": 1,
            "plain_forward_s": round(med(p[0] for p, _ in rows), 4), "audit_s": round(med(a[0] for _, a in rows), 4),
            "audit_forward_s": round(med(a[2] for _, a in rows), 4), "audit_analysis_s": round(med(a[3] for _, a in rows), 4),
            "ratio_median": round(med(wall), 3), "ratios": [round(x, 3) for x in wall],
            "cpu_ratio_median": round(med(cpu), 3), "cpu_ratios": [round(x, 3) for x in cpu], "target": 1.1}


def _cost_in_fresh_process(args: argparse.Namespace) -> dict:
    """The cost section in an interpreter of its own: vLLM's CPU worker binds the threads and memory of the
    process it ran in, and a forward there after it took 3.0 s against 0.53 s in a fresh one."""
    import subprocess

    cmd = [sys.executable, __file__, "--json", "--families", "", "--repeats", str(args.repeats), "--cost-size",
           args.cost_size, "--cost-batch", str(args.cost_batch), "--cost-tokens", str(args.cost_tokens)]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])["cost"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated of {list(FAMILIES)}")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--engines", default="hf,vllm", help="engines whose routes calibrate: hf (each sample alone), vllm")
    ap.add_argument("--cost-batch", type=int, default=8)
    ap.add_argument("--cost-tokens", type=int, default=256)
    ap.add_argument("--cost-size", default="bench", help="size preset of the cost model (tiny for a smoke run)")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds of the cost comparison (0: skip it)")
    args = ap.parse_args()
    torch.manual_seed(0)
    out: dict = {"thresholds": THRESHOLDS.to_dict(), "calibration": {}, "false_alarms": [], "faults": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in [f for f in args.families.split(",") if f]:
            t0 = time.perf_counter()
            cal, alarms, faults = run_family(name, root, args.samples, args.tokens, args.engines.split(","))
            out["calibration"][name] = cal
            out["false_alarms"] += alarms
            out["faults"] += faults
            _log(f"{name}: {sum(f['correct'] for f in faults)}/{len(faults)} faults named, "
                 f"{sum(a['false_alarms'] for a in alarms)} false alarms, {time.perf_counter() - t0:.1f} s")
        if args.repeats and out["calibration"]:
            out["cost"] = _cost_in_fresh_process(args)
        elif args.repeats:
            out["cost"] = cost(root, args.cost_batch, args.cost_tokens, args.repeats, args.cost_size)
    out["by_routing_rule"] = {}
    for rule in sorted({f["routing_rule"] for f in out["faults"]} | {a["routing_rule"] for a in out["false_alarms"]}):
        fs = [f for f in out["faults"] if f["routing_rule"] == rule]
        al = [a for a in out["false_alarms"] if a["routing_rule"] == rule]
        out["by_routing_rule"][rule] = {
            "families": sorted({f["family"] for f in fs} | {a["family"] for a in al}), "faults": len(fs),
            "detected": sum(f["detected"] for f in fs), "named_cause": sum(f["correct"] for f in fs),
            "misnamed": sorted({f"{f['family']}/{f['fault']}/{f['format']}: {f['named_cause']}" for f in fs if not f["correct"]}),
            "false_alarms": sum(a["false_alarms"] for a in al), "correct_batches": len(al),
            "correct_samples": sum(a["samples"] for a in al)}
    cal = [v for fam in out["calibration"].values() for v in fam.values()]
    out["summary"] = {
        "faults": len(out["faults"]), "detected": sum(f["detected"] for f in out["faults"]),
        "named_correctly": sum(f["correct"] for f in out["faults"]),
        "false_alarms": sum(a["false_alarms"] for a in out["false_alarms"]),
        "correct_batches": len(out["false_alarms"]),
        "correct_min_sample_agreement": min((c["min_sample"] for c in cal), default=None),
        "correct_min_layer_agreement": min((c["min_layer"] for c in cal), default=None),
        "correct_min_window_agreement": min((c["min_window"] for c in cal), default=None),
        "correct_max_set_flip_rate": max((c["set_flip_rate"] for c in cal), default=None),
        "correct_max_neighbour_gain": max((c["max_neighbour_gain"] for c in cal), default=None),
        "misaligned_max_sample_agreement": max((f["max_sample_agreement"] for f in out["faults"]
                                                if f["fault"] in EVERY_ROW), default=None),
        "cost_ratio_median": out.get("cost", {}).get("ratio_median"),
        "cost_cpu_ratio_median": out.get("cost", {}).get("cpu_ratio_median"),
    }
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
