"""Rollouts on an in-process `sglang.Engine` through `moe_replay.enable`, run in the bed's venv (bed.run_driver).

    .venv/sglang/bin/python tests/sglang_bed/engine_driver.py OUT_DIR MODEL_DIR [MODEL_DIR ...] [--max-new-tokens 12]

Builds the engine with the bed's arguments, attaches the `r3_support` preset (`enable(preset, llm=engine)`:
the `sglang.Engine` binding), generates the scenario's requests (SAMPLING: truncations and greedy) into a
DirectoryStore at OUT_DIR/<model dir name>/store, and writes summary.json beside it: the binding, the
geometry, the keys, the times, what an estimator preset raised and the bytes of SGLang's route payloads
(`wire`: base64 characters of `routed_experts` and the token-layers they hold, dense layers included). Errors go to summary["error"] (exit 1). The work sits under `__main__`: SGLang's spawned scheduler
imports this file again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bed  # noqa: E402

PROMPTS = ["the cat route token model", "expert layer sample mixture alpha beta dog the cat", "alpha",
           "model expert the dog beta beta route"]
SAMPLING = [dict(temperature=1.0, top_k=20, top_p=0.9), dict(temperature=0.7, top_k=5), dict(temperature=1.2, top_k=30,
            top_p=0.8), dict(temperature=0.0)]
"""One per prompt: top-k with top-p, top-k alone, a wider top-k with top-p, greedy (SGLang's kept sets need a
finite top_k <= 4096 or greedy)."""


def refusal(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the name and message are the result
        return f"{type(e).__name__}: {e}"
    return ""


def run_one(model_dir: str, out: Path, max_new_tokens: int) -> dict:
    """One engine on `model_dir`: the estimator refusal, then the scenario's traces into out/store."""
    import sglang

    import moe_replay
    from moe_replay.store import DirectoryStore

    t0 = time.monotonic()
    summary: dict = {}
    engine = sglang.Engine(model_path=model_dir, **bed.engine_args())
    summary["engine_start_s"] = round(time.monotonic() - t0, 1)
    try:
        summary["refusals"] = {"estimator": refusal(lambda: moe_replay.enable("r3_support_multisample", llm=engine))}
        mr = moe_replay.enable("r3_support", llm=engine)
        params = [dict(p, max_new_tokens=max_new_tokens, ignore_eos=True) for p in SAMPLING]
        t1 = time.monotonic()
        with DirectoryStore(out / "store") as store:
            outputs, traces = mr.generate(PROMPTS, params, store=store)
        g = mr.capture.geometry
        summary["wire"] = {"routed_experts_bytes": sum(len(o["meta_info"]["routed_experts"]) for o in outputs),
                           "token_layers": sum(t.num_route_rows for t in traces) * g.num_layers}
        summary.update(engine_kind=mr.engine_kind, geometry=mr.capture.geometry.to_dict(), keys=[t.key for t in traces],
                       generate_s=round(time.monotonic() - t1, 2), engine=mr.capture.engine_info.to_dict())
        mr.close()
    finally:
        engine.shutdown()
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("model_dirs", nargs="+", help="one engine each, one after the other (sglang imported once here)")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    args = ap.parse_args()
    root = Path(args.out_dir)
    failed = False
    for model_dir in args.model_dirs:
        out = root / Path(model_dir).name
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            summary = run_one(model_dir, out, args.max_new_tokens)
        except Exception:  # noqa: BLE001 - the test reads it; the next model still runs
            summary, failed = {"error": traceback.format_exc()[-4000:]}, True
        summary["seconds"] = round(time.monotonic() - t0, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
