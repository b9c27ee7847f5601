"""π_old on an `sglang.Engine` with the force hook, run in the bed's venv (bed.run_driver): forced scores to compare.

    .venv/sglang/bin/python tests/sglang_bed/score_driver.py OUT_DIR MODEL_DIR [--no-hook-engine]

One engine with the radix cache off and the force hook in its processes (MOE_REPLAY_SGLANG_FORCE=1: the bed's
sitecustomize loads integrations/sglang/force.py): `moe_replay.enable("r3_support_multisample", llm=engine)`
captures the scenario's rollouts into OUT_DIR/store, then scores them forced under their own routes and under
shifted routes (every expert id + 1 mod E: routes the engine would not choose), and runs the preset's π_old
(`mr.pi_old`). With --no-hook-engine, a second engine without the hook, which SglangScorer must refuse by name
(the benchmark's check; the tests check the probe on canned replies). Writes OUT_DIR/scores.npz (per trace:
own, shifted, pi_old) and OUT_DIR/summary.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bed  # noqa: E402
from compare import shifted  # noqa: E402
from engine_driver import PROMPTS, SAMPLING, refusal  # noqa: E402


def main() -> None:
    out, model_dir = Path(sys.argv[1]), sys.argv[2]
    no_hook = "--no-hook-engine" in sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    t0 = time.monotonic()
    try:
        import numpy as np
        import sglang

        import moe_replay
        from moe_replay.integrations.sglang.scoring import SglangScorer  # noqa: F401 (--no-hook-engine)
        from moe_replay.store import DirectoryStore

        os.environ["MOE_REPLAY_SGLANG_FORCE"] = "1"  # the scheduler this engine spawns loads the hook
        engine = sglang.Engine(model_path=model_dir, **bed.engine_args(disable_radix_cache=True))
        summary["engine_start_s"] = round(time.monotonic() - t0, 1)
        try:
            mr = moe_replay.enable("r3_support_multisample", llm=engine)
            params = [dict(p, max_new_tokens=10, ignore_eos=True) for p in SAMPLING]
            with DirectoryStore(out / "store") as store:
                _, traces = mr.generate(PROMPTS, params, store=store)
            t1 = time.monotonic()
            own = mr.scorer.score_batch(traces)
            summary["score_s"] = round(time.monotonic() - t1, 3)
            moved = mr.scorer.score_batch([shifted(t) for t in traces])
            t2 = time.monotonic()
            pi_old = mr.pi_old(traces)
            summary.update(pi_old_s=round(time.monotonic() - t2, 3), n=mr.preset.estimator.config.n,
                           keys=[t.key for t in traces], tokens=int(sum(len(x) for x in own)))
            np.savez(out / "scores.npz", own=np.concatenate(own), shifted=np.concatenate(moved), pi_old=pi_old)
            mr.close()
        finally:
            engine.shutdown()
        if no_hook:
            os.environ["MOE_REPLAY_SGLANG_FORCE"] = "0"  # an engine whose scheduler has no hook
            engine = sglang.Engine(model_path=model_dir, **bed.engine_args(disable_radix_cache=True))
            try:
                summary["refusals"] = {"no_hook": refusal(lambda: SglangScorer(engine))}
            finally:
                engine.shutdown()
    except Exception:  # noqa: BLE001 - the test reads it
        summary["error"] = traceback.format_exc()[-4000:]
    summary["seconds"] = round(time.monotonic() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    sys.exit(1 if "error" in summary else 0)


if __name__ == "__main__":
    main()
