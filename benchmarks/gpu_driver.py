"""One go on the GPU machine: every GPU measurement of the project, each step in its own process with
a timeout, results written as they arrive. Needs one CUDA GPU (and vLLM for the engine steps);
`--plan` runs every step's own --plan / --dry-run instead, on any machine (tests/test_gpu_driver.py).

A lent GPU machine gives a session 15 minutes, start and transfers included, so the steps run in
order of what they need and cost, and a step that fails or runs out of time is recorded and the
next one starts:

  env        GPU, driver, torch / transformers / vLLM versions; the moe_replay plugin entry point
             vLLM loads in every engine process (capture binds at model load through it)
  trainer    benchmarks/gpu_trainer.py: HF replay in bf16 under FSDP2 over NCCL, the project's
             collectives on an NCCL group (torch + transformers only)
  scoring    benchmarks/scoring.py --device cuda: support scoring at V = 151,936
  capture    benchmarks/gpu_capture.py: throughput graphs / graphs_capture, one process per engine
             (started together), interleaved rounds, capture's host-time breakdown (eager's 0.32x of
             graphs is known from gpu.md; a third cold start would not fit the lease)
  estimator  benchmarks/gpu_estimator.py --quick: forced and free scoring on a graph engine, the
             estimator at n = 1/2/4/8 (replicas in flight together, and drained per batch-size
             bucket) vs the HF recompute, variance vs n, a host profile of n = 4
  estimator_core  benchmarks/gpu_estimator.py --ratio-only --core process: the estimator at n = 1/4 vs
             the HF recompute with vLLM's engine core in its own process (it steps while the
             requests are still being added)
  native     benchmarks/gpu_capture.py: graphs_native throughput and native_vs_hooks
  mrv2       benchmarks/gpu_mrv2.py: which runner the engine runs with VLLM_USE_V2_MODEL_RUNNER=1 / 0,
             what capture takes from it (or refuses: vLLM 0.26's MRV2 has no routed experts) and
             whether its traces replay in HF

Seen on an H200 (2026-11-27): a cold torch.compile + CUDA-graph start of the bench model takes
~140 s; five such starts in parallel did not finish in 245 s, and two in parallel not in 220 s (a
rerun a minute later, on the compile caches the first left, started both in ~150 s); so capture
starts two engines with a start limit that fits two cold starts, and the native comparison is a step
of its own, last.

`--steps` picks steps (the transfers that bring vLLM can run env,trainer,scoring while vLLM is
still on its way); `--budget-s` is the wall time for all of them: each step gets its own limit or
what is left, whichever is less. Writes `<out>/gpu-results.json` (one object: step -> parsed JSON,
or the error and the log's tail) after every step, and `<out>/gpu-log.txt` (every step's output).

Usage: python benchmarks/gpu_driver.py --out DIR [--steps env,trainer,...] [--budget-s 480] [--plan]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moe_replay.report.bench import last_json_object as last_json  # the steps print one JSON object last

HERE = Path(__file__).resolve().parent
PY = sys.executable


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    plan_argv: tuple[str, ...]
    timeout_s: int


ENV_CODE = r"""
import json, subprocess
out = {}
try:
    out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                        "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as e:
    out["nvidia_smi"] = repr(e)
import torch, transformers
out.update(torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda,
           gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
try:
    import vllm
    out["vllm"] = vllm.__version__
    from moe_replay.integrations.vllm.versions import check_vllm_version
    check_vllm_version()
    out["vllm_supported"] = True
except Exception as e:
    out["vllm_error"] = f"{type(e).__name__}: {e}"
from importlib.metadata import entry_points
out["plugins"] = sorted(f"{e.name}={e.value}" for e in entry_points(group="vllm.general_plugins"))
import moe_replay
out["moe_replay"] = moe_replay.__file__
print(json.dumps(out))
"""

STEPS = (
    Step("env", (PY, "-c", ENV_CODE), (PY, "-c", ENV_CODE), 90),
    Step("trainer", (PY, str(HERE / "gpu_trainer.py")), (PY, str(HERE / "gpu_trainer.py"), "--plan"), 120),
    Step("scoring", (PY, str(HERE / "scoring.py"), "--json", "--device", "cuda", "--g", "2048,16384",
                     "--repeats", "3"),
         (PY, str(HERE / "scoring.py"), "--json", "--g", "64", "--repeats", "1"), 120),
    Step("capture", (PY, str(HERE / "gpu_capture.py"), "--rounds", "10", "--start-timeout-s", "300",
                     "--settings", "graphs,graphs_capture"),
         (PY, str(HERE / "gpu_capture.py"), "--dry-run", "--settings", "graphs,graphs_capture"), 360),
    Step("estimator", (PY, str(HERE / "gpu_estimator.py"), "--json", "--quick"),
         (PY, str(HERE / "gpu_estimator.py"), "--json", "--quick", "--plan"), 330),
    Step("estimator_core", (PY, str(HERE / "gpu_estimator.py"), "--json", "--ratio-only", "--core", "process"),
         (PY, str(HERE / "gpu_estimator.py"), "--json", "--ratio-only", "--core", "process", "--plan"), 240),
    Step("native", (PY, str(HERE / "gpu_capture.py"), "--rounds", "1", "--start-timeout-s", "200",
                    "--settings", "graphs_native,native_vs_hooks"),
         (PY, str(HERE / "gpu_capture.py"), "--dry-run", "--settings", "graphs_native,native_vs_hooks"), 240),
    Step("mrv2", (PY, str(HERE / "gpu_mrv2.py")), (PY, str(HERE / "gpu_mrv2.py"), "--dry-run"), 240),
)
NAMES = tuple(s.name for s in STEPS)


def run_step(step: Step, plan: bool, limit_s: float, log) -> dict:
    argv = step.plan_argv if plan else step.argv
    t0 = time.perf_counter()
    log.write(f"\n===== {step.name} (limit {limit_s:.0f} s): {' '.join(argv)[:300]}\n")
    log.flush()
    try:
        # cwd: `python -c` puts the working directory first on sys.path, and the checkout's root holds a
        # moe_replay/ without integrations/ (pyproject maps that in): the env step imported it on an H200
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s, env=os.environ.copy(), cwd=HERE)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        timed_out = False
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc, timed_out = None, True
    wall = round(time.perf_counter() - t0, 1)
    log.write(stderr[-60000:])
    log.write("\n----- stdout\n" + stdout[-20000:] + "\n")
    log.flush()
    parsed = last_json(stdout)
    row = {"rc": rc, "timed_out": timed_out, "wall_s": wall}
    if parsed is not None and rc == 0:
        row["result"] = parsed
    else:
        row["result"] = parsed
        row["stderr_tail"] = stderr[-3000:]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--steps", default=",".join(NAMES))
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--plan", action="store_true", help="run each step's --plan / --dry-run (no GPU needed)")
    args = ap.parse_args(argv)
    names = [s for s in args.steps.split(",") if s]
    bad = [s for s in names if s not in NAMES]
    if bad or not names:
        ap.error(f"--steps: unknown {bad}; choose from {','.join(NAMES)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "gpu-results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    deadline = time.perf_counter() + args.budget_s
    with open(out_dir / "gpu-log.txt", "a") as log:
        for step in (s for s in STEPS if s.name in names):
            left = deadline - time.perf_counter()
            if left < 10:
                results[step.name] = {"skipped": f"no time left ({left:.0f} s of the budget)"}
            else:
                results[step.name] = run_step(step, args.plan, min(step.timeout_s, left), log)
            results_path.write_text(json.dumps(results, indent=1))
            r = results[step.name]
            print(json.dumps({"step": step.name, "rc": r.get("rc"), "timed_out": r.get("timed_out"),
                              "wall_s": r.get("wall_s"), "skipped": r.get("skipped"),
                              "parsed": r.get("result") is not None}), flush=True)
    print(json.dumps({"steps": {k: ("ok" if v.get("rc") == 0 and v.get("result") is not None else "failed")
                                for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
