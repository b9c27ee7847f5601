"""Rollout throughput with and without capture on a GPU vLLM engine (CUDA graphs + compile).

Five settings, each its own engine in its own process (vLLM 0.26 keeps CUDA-graph state per process:
a second graph engine in one process dies with "CUDA graph capturing detected at an inappropriate
time", measured on an H200), all alive at once (a slice of GPU memory each, started in parallel) and
measured in interleaved rounds driven over a line protocol, so drift of the machine hits every
setting alike:

  graphs              vLLM's default (torch.compile + CUDA graphs), no capture: the reference
  graphs_native       + vLLM's own `enable_return_routed_experts` (routes only; the outputs'
                      `routed_experts` are read, so their transfer is paid)
  eager               enforce_eager=True, no capture
  eager_capture       enforce_eager=True + moe_replay capture (routes + support + logprobs)
  graphs_capture      graphs + moe_replay capture (routes written into the step buffer bound at
                      model load, inside the CUDA graph; support + logprobs; collect included)

And one check, `native_vs_hooks` (chosen with --settings; not a throughput setting): one engine built
with vLLM's `enable_return_routed_experts=True`, the capture extension and prefix caching runs the
workload twice (the second pass reads cached prefixes); every completion's routes from vLLM's
output (integrations/vllm/capture/native.py) are compared with moe_replay's hook capture of the same run.
Prints `native_vs_hooks`: identical-route fraction per MoE layer (column order kept) and overall,
the same as sets, and how many traces are identical. Where the hooks cannot bind next to vLLM's own
capture function (a router holds one capture_fn), the refusal is reported and the hooks run on a
second engine without the flag on the same seeded requests (`same_engine: false`; positions of
completions whose tokens differ between the engines are left out and counted).

Model: `build_tiny_model("qwen3_moe", size="bench", num_experts=64, num_experts_per_tok=8,
hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8)`, bf16; 128 prompts of 16-64
words, 128 generated tokens each (ignore_eos), top_p 0.95, max_num_seqs 128, prefix caching off.
Prints one JSON object: per setting tokens/s (median over rounds) and `vs_graphs`, the median of
per-round ratios to `graphs`, with `vs_graphs_ci95`, the distribution-free 95% interval of that median
(order statistics; 10 rounds give the 2nd and 9th ratio, fewer than 6 none); `capture_throughput_ratio`
and `capture_throughput_ratio_ci95` are graphs_capture's. Target: >= 0.97, read with its interval.
For each capture setting, `breakdown`: capture's host seconds per part over the measured rounds
(VllmCapture.timings(): per-step, per-flush, per-take and client parts) and each part's share of
those rounds' wall time, so a GPU run shows where capture's time goes.

Needs a GPU build of vLLM accepted on the V1 path (integrations/vllm/versions.py, surface table); written for
vLLM 0.26 on one H100 / H200. `--dry-run` checks the plan on any machine: it builds every setting's
EngineArgs against the installed vLLM (on the tiny model; no engine, no GPU) and prints the plan as JSON.

Usage: python benchmarks/gpu_capture.py [--rounds 3] [--settings graphs,graphs_capture,...,native_vs_hooks]
       [--plan | --dry-run] [--compare-eager]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from moe_replay.report.bench import median_ci95

SETTINGS = ("graphs", "graphs_native", "eager", "eager_capture", "graphs_capture")
COMPARE = "native_vs_hooks"
MODEL = dict(family="qwen3_moe", size="bench", num_experts=64, num_experts_per_tok=8, hidden_size=1024,
             moe_intermediate_size=512, num_hidden_layers=8)


KV_CACHE_BYTES = 1 << 30
"""KV cache of each engine, given rather than profiled: two engines starting together each measure the
GPU's free memory while the other allocates, and one was left with "No available memory for the cache
blocks" (H200, vLLM 0.26). The workload needs 128 sequences x 512 tokens x 8 KiB (8 layers, 4 KV heads
of 64, bf16) = 512 MiB."""


def engine_kwargs(setting: str, model_dir: str, gpu_memory_utilization: float, num_prompts: int,
                  compare_eager: bool = False) -> dict:
    """LLM(...) keyword arguments of one setting."""
    if setting not in SETTINGS + (COMPARE,):
        raise ValueError(f"unknown setting {setting!r}; expected one of {SETTINGS + (COMPARE,)}")
    kw = dict(model=model_dir, dtype="bfloat16", max_model_len=512, max_num_seqs=num_prompts, seed=0,
              enable_prefix_caching=setting == COMPARE, gpu_memory_utilization=gpu_memory_utilization,
              kv_cache_memory_bytes=KV_CACHE_BYTES,
              enforce_eager=setting.startswith("eager") or (setting == COMPARE and compare_eager))
    if setting in ("graphs_native", COMPARE):
        kw["enable_return_routed_experts"] = True
    if setting.endswith("_capture") or setting == COMPARE:
        from moe_replay.integrations.vllm import capture_engine_kwargs

        kw = capture_engine_kwargs(**kw)
    return kw


def workload(num_prompts: int, seed: int = 0) -> list[str]:
    import numpy as np

    words = "the cat route token model expert layer sample mixture alpha beta dog".split()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, int(rng.integers(16, 65)))) for _ in range(num_prompts)]


def plan(args: argparse.Namespace, model_dir: str) -> dict:
    return {name: engine_kwargs(name, model_dir, args.gpu_memory_utilization, args.prompts, args.compare_eager)
            for name in args.settings}


def compare_native_hooks(kwargs: dict, prompts: list[str], max_tokens: int, top_p: float) -> dict:
    """Routes from vLLM's own output vs moe_replay's hooks on one run (see the module docstring)."""
    import numpy as np
    from vllm import LLM, SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, CaptureHookError, CollectError, VllmCapture
    from moe_replay.integrations.vllm.capture.native import routes_from_native

    params = [SamplingParams(temperature=1.0, top_p=top_p, max_tokens=max_tokens, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    out: dict = {"same_engine": True, "sources": ["native", "hooks"]}
    native_outs, hooks_traces, geometry = [], [], None
    llm = LLM(**kwargs)
    try:
        try:
            with VllmCapture(llm, CaptureConfig(source="hooks")) as cap:
                for _ in range(2):  # the second pass reads the prefix cache the first one filled
                    o, t = cap.generate(prompts, params, use_tqdm=False)
                    native_outs += o
                    hooks_traces += t
                geometry = cap.geometry
        except (CaptureHookError, CollectError) as e:  # vLLM's capturer holds the routers' capture_fn
            out.update(same_engine=False, hooks_refused=f"{type(e).__name__}: {e}")
            llm.reset_prefix_cache()
            native_outs, hooks_traces = [], []
            for _ in range(2):
                native_outs += llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    if not out["same_engine"]:
        kw = {k: v for k, v in kwargs.items() if k != "enable_return_routed_experts"}
        llm = LLM(**kw)
        try:
            with VllmCapture(llm, CaptureConfig(source="hooks")) as cap:
                for _ in range(2):
                    hooks_traces += cap.generate(prompts, params, use_tqdm=False)[1]
                geometry = cap.geometry
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    comps = [(o, c) for o in native_outs for c in o.outputs]
    same_RL, same_set_RL, identical, token_mismatch, refused = [], [], 0, 0, []
    for (o, c), t in zip(comps, hooks_traces):
        if not np.array_equal(t.token_ids_S[t.prompt_len:], np.asarray(c.token_ids)):
            token_mismatch += 1
            continue
        try:
            nat_TLK = routes_from_native(t.key, c.routed_experts, t.num_tokens, 0, geometry)[t.route_start:]
        except Exception as e:  # counted and the first one reported: the layout differs from 0.32's
            refused.append(f"{type(e).__name__}: {e}")
            continue
        eq_TLK = nat_TLK == t.routes_TLK
        same_RL.append(eq_TLK.all(-1))
        same_set_RL.append((np.sort(nat_TLK, -1) == np.sort(t.routes_TLK, -1)).all(-1))
        identical += bool(eq_TLK.all())
    out.update(completions=len(comps), compared=len(same_RL), token_mismatch=token_mismatch,
               native_refused=len(refused), first_native_refusal=refused[0] if refused else None)
    if not same_RL:
        return out
    same, same_set = np.concatenate(same_RL), np.concatenate(same_set_RL)
    out.update(
        positions=int(len(same)),
        prefix_hit_requests=sum(1 for o in native_outs if (o.num_cached_tokens or 0) > 0),
        identical_route_fraction={str(lid): round(float(same[:, j].mean()), 6)
                                  for j, lid in enumerate(geometry.moe_layer_ids)},
        identical_route_fraction_all=round(float(same.mean()), 6),
        identical_set_fraction_all=round(float(same_set.mean()), 6),
        traces_identical=identical)
    return out


def check_plan(p: dict) -> None:
    """Every setting's kwargs are EngineArgs fields of the installed vLLM (built, not started)."""
    from vllm.engine.arg_utils import EngineArgs

    for name, kw in p.items():
        EngineArgs(**kw)


class Setting:
    def __init__(self, name: str, kwargs: dict) -> None:
        from vllm import LLM

        self.name = name
        self.llm = LLM(**kwargs)
        self.capture = None
        if name.endswith("_capture"):
            from moe_replay.integrations.vllm import CaptureConfig, VllmCapture

            self.capture = VllmCapture(self.llm, CaptureConfig())

        self.wall_s = 0.0

    def reset_timings(self) -> None:
        """Start the breakdown's window (after the warm-up pass)."""
        self.wall_s = 0.0
        if self.capture is not None and hasattr(self.capture, "timings"):
            self.capture.timings(reset=True)

    def breakdown(self) -> dict | None:
        """Capture's host seconds per part over the measured passes, and each part's share of their wall time."""
        if self.capture is None or not hasattr(self.capture, "timings") or self.wall_s <= 0:
            return None
        parts = self.capture.timings()
        return {"wall_s": round(self.wall_s, 3),
                "parts": {k: {"s": round(float(v["s"]), 4), "calls": int(v["calls"]),
                              "share": round(float(v["s"]) / self.wall_s, 5)} for k, v in parts.items()},
                "host_share": round(sum(float(v["s"]) for v in parts.values()) / self.wall_s, 5)}

    def run(self, prompts: list[str], params) -> float:
        """Generated tokens per second of one pass (collect included for capture)."""
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        if self.capture is not None:
            self.capture.collect(outs)
        if self.name == "graphs_native":
            rows = sum(len(c.routed_experts) for o in outs for c in o.outputs)  # materialised, not lazy
            assert rows > 0, "enable_return_routed_experts returned no routes"
        dt = time.perf_counter() - t0
        self.wall_s += dt
        return sum(len(c.token_ids) for o in outs for c in o.outputs) / dt

    def close(self) -> None:
        if self.capture is not None:
            self.capture.uninstall()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.12,
                    help="per engine; all settings' engines are alive at once")
    ap.add_argument("--model-dir", default=None, help="reuse a built model instead of building it")
    ap.add_argument("--dry-run", "--plan", dest="dry_run", action="store_true",
                    help="check and print the plan only (no engine, no GPU)")
    ap.add_argument("--compare-eager", action="store_true", help=f"run {COMPARE} with enforce_eager=True")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # child: one setting's engine
    ap.add_argument("--start-timeout-s", type=float, default=400.0, help="per engine start (cold compile included)")
    ap.add_argument("--run-timeout-s", type=float, default=120.0, help="per pass")
    args = ap.parse_args(argv)
    args.settings = [s for s in args.settings.split(",") if s]
    bad = [s for s in args.settings if s not in SETTINGS + (COMPARE,)]
    if bad or not args.settings:
        ap.error(f"--settings: unknown {bad}; choose from {','.join(SETTINGS + (COMPARE,))}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.dry_run:  # EngineArgs wants a real checkpoint: the tiny one stands in for the bench model
        from moe_replay.models import build_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            p = plan(args, args.model_dir or str(build_tiny_model("qwen3_moe", Path(tmp) / "tiny", seed=0)))
            check_plan(p)
        out = {"benchmark": "gpu_capture", "dry_run": True, "model": MODEL, "rounds": args.rounds,
               "prompts": args.prompts, "max_tokens": args.max_tokens, "top_p": args.top_p, "settings": p}
        if COMPARE in p:
            out["compare"] = {"setting": COMPARE, "sources": ["native", "hooks"], "passes": 2}
        print(json.dumps(out, default=str))
        return 0

    if args.serve:
        return serve(args)
    import vllm

    from moe_replay.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            spec = dict(MODEL)
            model_dir = str(build_tiny_model(spec.pop("family"), Path(tmp) / "bench", seed=0, **spec))
        child_args = ["--model-dir", model_dir, "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
                      "--top-p", str(args.top_p), "--gpu-memory-utilization", str(args.gpu_memory_utilization)] + \
            (["--compare-eager"] if args.compare_eager else [])
        children = [Child(name, child_args) for name in args.settings]  # every engine starts at once
        compare, tps, breakdowns, failed = None, {}, {}, {}
        try:
            ready = []
            for c in children:
                try:
                    reply = c.reply(args.start_timeout_s)
                except (TimeoutError, RuntimeError) as e:
                    failed[c.name] = str(e)
                    continue
                if reply.get("ready"):
                    ready.append(c)
                elif c.name == COMPARE and "result" in reply:
                    compare = reply["result"]
                else:
                    failed[c.name] = reply.get("error") or reply
            tps = {c.name: [] for c in ready}
            for c in ready:  # warm-up pass each (compile / graph capture already happened at start)
                c.ask("run", args.run_timeout_s)
                c.ask("reset", args.run_timeout_s)
            for r in range(args.rounds):
                order = ready[r % len(ready):] + ready[: r % len(ready)] if ready else []  # rotate the order
                for c in order:
                    tps[c.name].append(c.ask("run", args.run_timeout_s)["tokens_per_s"])
            breakdowns = {c.name: c.ask("breakdown", args.run_timeout_s).get("breakdown") for c in ready}
        finally:
            for c in children:
                c.close()
    out = {"benchmark": "gpu_capture", "vllm": vllm.__version__, "device": _device_name(), "model": MODEL,
           "rounds": args.rounds, "prompts": args.prompts, "max_tokens": args.max_tokens, "top_p": args.top_p,
           **summarize(tps, breakdowns)}
    if compare is not None:
        out[COMPARE] = compare
    if failed:
        out["failed"] = failed
    print(json.dumps(out, default=str))
    return 0


def summarize(tps: dict[str, list[float]], breakdowns: dict[str, dict | None]) -> dict:
    """`settings` (per setting: median tokens/s, the rounds, and against `graphs` the median of the
    per-round ratios with its 95% interval; the breakdown where capture ran) and
    `capture_throughput_ratio` (+ `_ci95`) where graphs_capture and graphs both ran. Round r of every
    setting ran back to back, so a per-round ratio compares runs under the same machine state."""
    out: dict = {"settings": {}}
    for name, runs in tps.items():
        row = {"tokens_per_s": round(statistics.median(runs), 1), "runs": [round(x, 1) for x in runs]}
        if "graphs" in tps:
            ratios = [a / b for a, b in zip(runs, tps["graphs"])]
            row["vs_graphs"] = round(statistics.median(ratios), 4)
            row["vs_graphs_ci95"] = median_ci95(ratios)
        if breakdowns.get(name) is not None:
            row["breakdown"] = breakdowns[name]
        out["settings"][name] = row
    if "graphs_capture" in out["settings"] and "vs_graphs" in out["settings"]["graphs_capture"]:
        out["capture_throughput_ratio"] = out["settings"]["graphs_capture"]["vs_graphs"]
        out["capture_throughput_ratio_ci95"] = out["settings"]["graphs_capture"]["vs_graphs_ci95"]
    return out


PROTOCOL = "@@gpu_capture "
"""Prefix of the child's protocol lines on stdout (vLLM logs there too)."""


class Child:
    """One setting's engine in its own process: `ask(cmd)` sends a command line and waits for its reply."""

    def __init__(self, name: str, child_args: list[str]) -> None:
        import queue
        import subprocess
        import threading

        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", name, *child_args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lines: "queue.Queue[str | None]" = queue.Queue()

        def pump() -> None:
            for line in self.proc.stdout:
                if line.startswith(PROTOCOL):
                    self.lines.put(line[len(PROTOCOL):])
                else:
                    sys.stderr.write(f"[{name}] {line}")
            self.lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def reply(self, timeout_s: float) -> dict:
        import queue

        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"setting {self.name}: no reply in {timeout_s:.0f} s") from None
        if line is None:
            raise RuntimeError(f"setting {self.name}: the process exited (rc {self.proc.wait()})")
        return json.loads(line)

    def ask(self, cmd: str, timeout_s: float) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        got = self.reply(timeout_s)
        if "error" in got:
            raise RuntimeError(f"setting {self.name}: {got['error']}")
        return got

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - a stuck engine is killed
            self.proc.kill()


def serve(args: argparse.Namespace) -> int:
    """Child: build one setting's engine, answer "run" / "reset" / "breakdown" / "quit" on stdin."""
    from vllm import SamplingParams

    def say(obj: dict) -> None:
        print(PROTOCOL + json.dumps(obj, default=str), flush=True)

    name = args.serve
    prompts = workload(args.prompts)
    kw = engine_kwargs(name, args.model_dir, args.gpu_memory_utilization, args.prompts, args.compare_eager)
    try:
        if name == COMPARE:
            say({"result": compare_native_hooks(kw, prompts, args.max_tokens, args.top_p)})
            return 0
        setting = Setting(name, kw)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which goes on with the others
        say({"error": f"{type(e).__name__}: {e}"})
        return 1
    params = SamplingParams(temperature=1.0, top_p=args.top_p, max_tokens=args.max_tokens, ignore_eos=True)
    say({"ready": True})
    for line in sys.stdin:
        cmd = line.strip()
        try:
            if cmd == "run":
                say({"tokens_per_s": setting.run(prompts, params)})
            elif cmd == "reset":
                setting.reset_timings()
                say({"ok": True})
            elif cmd == "breakdown":
                say({"breakdown": setting.breakdown()})
            elif cmd == "quit":
                break
            else:
                say({"error": f"unknown command {cmd!r}"})
        except Exception as e:  # noqa: BLE001
            say({"error": f"{type(e).__name__}: {e}"})
    setting.close()
    return 0


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # stdout carries the JSON only
    sys.exit(main())
