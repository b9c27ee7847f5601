"""SGLang rollouts against HF, per family: exactness, the bytes on the wire and in the store, π_old; prints JSON.

    python benchmarks/sglang.py --json                              # every family build_tiny_model has
    python benchmarks/sglang.py --json --families qwen3_moe --max-new-tokens 4

Needs the SGLang CPU test bed (scripts/sglang_bed.py; `make test` builds it): per run one driver process in
its venv (tests/sglang_bed/engine_driver.py) builds an `sglang.Engine` per family in turn, attaches the
`r3_support` preset through `moe_replay.enable(preset, llm=engine)` and captures 4 requests (top-k with top-p,
top-k alone, a wider top-k with top-p, greedy; 12 tokens each) into a DirectoryStore; here HF (fp32) replays
them (tests/sglang_bed/compare.py).

Per family (`families`): engine "sglang", status (served / engine_fails / refused, with the reason), flips
(token-layers where HF's router picks other experts than SGLang's, under replay), max_abs_dlogprob (|HF - SGLang|
of the sampled tokens over the recorded kept sets), kept_sets_equal_hf (each kept set equals SGLang's rule over
HF's logits), wire_bytes_per_token_layer (SGLang's `routed_experts`: base64 of int32, dense layers included, as
it crosses HTTP), store_bytes_per_token_layer (the same routes in the project's codec, MoE layers only),
estimator (π_old on SGLang, forced through the hook at its top-k selection: its scores against HF's replay of the
same routes and of shifted routes, π_old's seconds at n = 4 against one HF recompute, `cost_vs_recompute`; or
the refusal and its reason).
Targets (issue 56): flips 0 and kept sets equal on every served family.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_moe_sparse")
"""Every family moe_replay.models.build_tiny_model builds."""


def store_bytes_per_token_layer(traces) -> float:
    from moe_replay.codec import ROUTE_CODECS

    codec = ROUTE_CODECS.get("moe_replay")
    g = traces[0].geometry
    return sum(len(codec.encode(t.routes_TLK, g.num_experts)[0]) for t in traces) / sum(
        t.routes_TLK.shape[0] * t.routes_TLK.shape[1] for t in traces)


def last_error(text: str) -> str:
    """The last line of a traceback that names an exception ("AssertionError: ..."; a bare assert with the source
    line above it), else the text's tail."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip(" ^~")]  # no caret lines
    hits = [i for i, ln in enumerate(lines) if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    if not hits:
        return text.strip()[-300:]
    i = hits[-1]
    return (lines[i] if ":" in lines[i] or i == 0 else f"{lines[i]} ({lines[i - 1]})")[:600]


def estimator(family: str, model_dir: Path, work: Path, run: bool) -> dict:
    """π_old on SGLang for one family: forced scoring (tests/sglang_bed/score_driver.py) against HF's replay, and its
    cost against HF's recompute; or why it is refused (families whose router the force hook does not replace)."""
    from moe_replay.integrations.sglang.scoring import FORCEABLE
    from moe_replay.store import DirectoryStore
    from tests.sglang_bed import bed
    from tests.sglang_bed.compare import compare_scores

    if family not in FORCEABLE:
        return {"status": "refused", "reason": f"SglangScoringError: SGLang routes {family} by another path than the "
                                               f"torch-native top-k the force hook replaces (forceable: {list(FORCEABLE)})"}
    if not run:
        return {"status": "not_run"}
    out = work / "score" / family
    proc = bed.run_driver(bed.BED / "score_driver.py", out, model_dir, "--no-hook-engine", timeout_s=900)
    path = out / "summary.json"
    s = json.loads(path.read_text()) if path.exists() else {"error": last_error(proc.stderr)}
    if "error" in s:
        return {"status": "error", "reason": last_error(s["error"])}
    with DirectoryStore(out / "store", readonly=True) as store:
        traces = store.get_many(s["keys"])
    import numpy as np

    got = compare_scores(model_dir, traces, dict(np.load(out / "scores.npz")))
    return {"status": "exact" if max(got["own_max_abs_vs_hf"], got["shifted_max_abs_vs_hf"]) <= 2e-5 else "inexact",
            "forced_max_abs_dlogprob_vs_replay": got["own_max_abs_vs_hf"],
            "shifted_routes_max_abs_dlogprob_vs_replay": got["shifted_max_abs_vs_hf"],
            "shift_moves_scores_by": round(got["shift_moves_scores_by"], 3), "n": s["n"], "tokens": s["tokens"],
            "pi_old_s": s["pi_old_s"], "hf_recompute_s": round(got["hf_recompute_s"], 4),
            "cost_vs_recompute": round(s["pi_old_s"] / got["hf_recompute_s"], 1),
            "no_hook_refused": s["refusals"]["no_hook"].startswith("SglangScoringError")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON summary (the default output)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--estimator-families", default="qwen3_moe,qwen2_moe,mixtral",
                    help="served families whose π_old is measured (an engine each, with the force hook); '' for none")
    args = ap.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    from moe_replay.integrations.sglang import SglangServedError, check_served
    from moe_replay.models import build_tiny_model
    from moe_replay.models.layout import read_config
    from moe_replay.store import DirectoryStore
    from tests.sglang_bed import bed
    from tests.sglang_bed.compare import compare_hf

    if not bed.available():
        print(json.dumps({"error": f"the SGLang test bed is not built ({bed.PYTHON}): python3 scripts/sglang_bed.py"}))
        return 1
    t0 = time.perf_counter()
    names = [f for f in args.families.split(",") if f]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        work = Path(tmp)
        models = {f: build_tiny_model(f, work / "models" / f, seed=0) for f in names}
        run = []
        for f, m in models.items():
            try:
                check_served(read_config(m), f)
                run.append(f)
            except SglangServedError as e:
                rows[f] = {"engine": "sglang", "status": "refused", "reason": str(e)}
        died: dict[str, str] = {}
        pending = list(run)
        while pending:  # SGLang kills its parent when a child fails to load: the family that was loading is named
            proc = bed.run_driver(bed.BED / "engine_driver.py", work / "out", *[models[f] for f in pending],
                                  "--max-new-tokens", str(args.max_new_tokens), timeout_s=1800)
            pending = [f for f in pending if not (work / "out" / f / "summary.json").exists()]
            if pending:
                died[pending.pop(0)] = f"the engine's process died ({proc.returncode}): {last_error(proc.stderr)}"
        for f in run:
            path = work / "out" / f / "summary.json"
            if f in died:
                rows[f] = {"engine": "sglang", "status": "engine_fails", "reason": died[f]}
                continue
            s = json.loads(path.read_text())
            if "error" in s:
                rows[f] = {"engine": "sglang", "status": "engine_fails", "reason": last_error(s["error"])}
                continue
            with DirectoryStore(work / "out" / f / "store", readonly=True) as store:
                traces = store.get_many(s["keys"])
            got = compare_hf(models[f], traces)
            rows[f] = {"engine": "sglang", "status": "served", "flips": got["flips"], "positions": got["positions"],
                       "max_abs_dlogprob": got["max_abs_dlogprob"], "kept_sets_equal_hf": got["kept_sets_equal_hf"],
                       "kept_rows": got["kept_rows"],
                       "wire_bytes_per_token_layer": round(s["wire"]["routed_experts_bytes"] / s["wire"]["token_layers"], 3),
                       "store_bytes_per_token_layer": round(store_bytes_per_token_layer(traces), 3),
                       "estimator": estimator(f, models[f], work, f in args.estimator_families.split(",")),
                       "engine_start_s": s["engine_start_s"], "generate_s": s["generate_s"],
                       "geometry": s["geometry"]}
    served = [f for f, r in rows.items() if r["status"] == "served"]
    out = {"engine": "sglang", "sglang": "0.5.23", "families": {f: rows[f] for f in names},
           "served": served, "targets_met": bool(served) and all(rows[f]["flips"] == 0 and rows[f]["kept_sets_equal_hf"] for f in served),
           "wall_seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
