"""Trainer-side token scoring at a real vocabulary (V = 151,936): time and peak extra memory.

Paths, on bf16 logits [G, V] (a leaf that requires grad, like an LM head's output):
  plain    log_softmax(logits.float()).gather(target): what a trainer does without moe_replay
           (full vocabulary, no support, no entropy);
  current  the dense [G, V] path this package replaced: support_mask_GV ([G, V] bool) + masked_logprobs (fp32
           copy, masked log_softmax, entropy), copied here verbatim;
  new      moe_replay.replay.score_logits as a trainer calls it (backend "auto": on CPU the
           compiled chunk math for these sizes): row chunks, CSR support, logprob and entropy;
  new_eager        the same with backend="torch_chunked" (eager torch ops per chunk);
  new_logprob_only the same as new with entropy=False (what TrainBatch.logprobs runs: plain's output).
Each with a top-p-like support of 1-64 kept ids per row ("support") and without ("full_vocab":
plain is the same computation in both). Modes: forward (training forward, grad enabled) and
forward+backward (loss = sum of the logprobs).

Memory: peak extra bytes / logits bytes, from the CPU allocator's own events (torch.profiler with
profile_memory: every allocation and free, including those of compiled code, which bypasses the
op dispatcher), over the call, relative to what was live before it. The gradient of the logits
(logits-sized, in their dtype) is what every path must return: `peak_over_logits` leaves it out,
`peak_over_logits_with_grad` counts it.
Host reads: `host_reads` (new_eager, the backend a CUDA call takes): how many times one forward +
backward reads a tensor's value on the host (moe_replay.replay.host_reads), each a wait for the
queued launches on a GPU; counted on a separate, untimed call.
Time: median ms of `--repeats` runs, all paths interleaved in one loop (the machine is shared).
`time_vs_plain` (new paths): forward+backward ms over plain's, same run and G.
Compile: the script runs with an empty inductor cache of its own, so `compile_s` (the first
forward+backward of `new`, less its steady-state time) is a cold compile.
On a GPU (`--device cuda`): memory is the CUDA caching allocator's peak (max_memory_allocated, reset
before each call) over what was allocated before it; time brackets each call with synchronize.

Usage: python benchmarks/scoring.py --json [--g 64,256] [--repeats 3] [--temperature 1.0] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

OWN_CACHE = None
if __name__ == "__main__" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a cold compile; removed at the end
    OWN_CACHE = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="scoring-bench-inductor-")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from moe_replay.replay import SupportCSR, score_logits  # noqa: E402
from moe_replay.replay.host_reads import HostReads  # noqa: E402
from moe_replay.trace import SamplingSupport  # noqa: E402

V = 151_936
MAX_KEPT = 64


def allocator_peak(events: Any) -> int:
    """Peak of the running sum of the allocator's [memory] events (bytes allocated > 0, freed < 0)."""
    mem = sorted((ev.start_ns(), ev.nbytes()) for ev in events if ev.name() == "[memory]")
    live = peak = 0
    for _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    return peak


# -- the dense [G, V] path (moe_replay.replay.support at 927a315), verbatim: the baseline -----------
def support_mask_GV(supports, rows_per_support, vocab_size: int, device="cpu") -> torch.Tensor:
    total = int(sum(rows_per_support))
    mask_GV = torch.zeros((total, vocab_size), dtype=torch.bool, device=device)
    start = 0
    for sup, rows in zip(supports, rows_per_support):
        if sup is None:
            mask_GV[start : start + rows] = True
        else:
            row_N = np.repeat(np.arange(rows, dtype=np.int64), sup.sizes_G()) + start
            mask_GV[torch.from_numpy(row_N).to(device), torch.from_numpy(sup.ids_N.astype(np.int64)).to(device)] = True
        start += rows
    return mask_GV


def masked_logprobs(logits_GV, target_G, mask_GV=None, temperature=1.0):
    x_GV = logits_GV.float()
    if isinstance(temperature, torch.Tensor):
        t_G = temperature.to(x_GV).reshape(-1, 1)
        x_GV = x_GV / torch.where(t_G > 0, t_G, torch.ones_like(t_G))
    elif temperature not in (0.0, 1.0):
        x_GV = x_GV / temperature
    if mask_GV is not None:
        x_GV = x_GV.masked_fill(~mask_GV, float("-inf"))
    logp_GV = torch.log_softmax(x_GV, dim=-1)
    logprobs_G = logp_GV.gather(1, target_G.reshape(-1, 1)).squeeze(1)
    safe_GV = logp_GV if mask_GV is None else logp_GV.masked_fill(~mask_GV, 0.0)
    entropy_G = -(safe_GV.exp() * safe_GV).sum(dim=-1)
    return logprobs_G, entropy_G


# -- one measured call per path ---------------------------------------------------------------------
DEVICE = "cpu"
"""Where the logits live (--device): the CPU allocator's profiler events or CUDA's allocator stats."""


def make_case(g: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    logits = (torch.randn(g, V, device=DEVICE) * 2).to(torch.bfloat16)
    sizes = rng.integers(1, MAX_KEPT + 1, g)
    rows = [np.sort(rng.choice(V, int(n), replace=False)) for n in sizes]
    target = torch.tensor([int(rng.choice(r)) for r in rows], device=DEVICE)
    sup = SamplingSupport.from_rows(rows)
    return {"logits": logits, "target": target, "support": sup, "csr": SupportCSR.from_supports([sup], [g])}


def paths(case: dict[str, Any], with_support: bool, temperature: float) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    target, sup, csr, g = case["target"], case["support"], case["csr"], case["target"].numel()

    def plain(x):
        return torch.log_softmax(x.float(), -1).gather(1, target[:, None]).squeeze(1)

    def current(x):
        mask = support_mask_GV([sup], [g], V, device=DEVICE) if with_support else None
        return masked_logprobs(x, target, mask, temperature)[0]

    def new(x):
        return score_logits(x, target, support=csr if with_support else None, temperature=temperature).logprobs_G

    def new_eager(x):
        return score_logits(x, target, support=csr if with_support else None, temperature=temperature,
                            backend="torch_chunked").logprobs_G

    def new_logprob_only(x):
        return score_logits(x, target, support=csr if with_support else None, temperature=temperature, entropy=False).logprobs_G

    return {"plain": plain, "current": current, "new": new, "new_eager": new_eager, "new_logprob_only": new_logprob_only}


def run_once(fn, logits: torch.Tensor, backward: bool, measure: bool) -> tuple[float, float, float]:
    """(seconds, peak extra bytes without the logits' grad, with it)."""
    x = logits.detach().requires_grad_(True)
    gc.collect()
    if DEVICE != "cpu":
        return _run_once_cuda(fn, x, backward, measure)
    t0 = time.perf_counter()
    if measure:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            lp = fn(x)
            if backward:
                lp.sum().backward()
    else:
        lp = fn(x)
        if backward:
            lp.sum().backward()
    dt = time.perf_counter() - t0
    if not measure:
        return dt, 0.0, 0.0
    peak = allocator_peak(prof.profiler.kineto_results.events())
    grad_bytes = x.grad.untyped_storage().nbytes() if (backward and x.grad is not None) else 0
    del lp
    return dt, peak - grad_bytes, peak


def _run_once_cuda(fn, x: torch.Tensor, backward: bool, measure: bool) -> tuple[float, float, float]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    lp = fn(x)
    if backward:
        lp.sum().backward()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - before
    grad_bytes = x.grad.untyped_storage().nbytes() if (backward and x.grad is not None) else 0
    del lp
    return (dt, peak - grad_bytes, peak) if measure else (dt, 0.0, 0.0)


def bench(gs: Sequence[int], repeats: int, temperature: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gi, g in enumerate(gs):
        case = make_case(g)
        if gi == 0:  # the first call of the default path compiles (cold cache): its cost over a warm call
            fn = paths(case, False, temperature)["new"]
            first = run_once(fn, case["logits"], True, measure=False)[0]
            warm = min(run_once(fn, case["logits"], True, measure=False)[0] for _ in range(2))
            out["compile_s"] = round(first - warm, 1)
        logits_bytes = case["logits"].numel() * case["logits"].element_size()
        for support_key, with_support in (("support", True), ("full_vocab", False)):
            fns = paths(case, with_support, temperature)
            res: dict[str, dict[str, Any]] = {name: {} for name in fns}
            for mode_key, backward in (("forward", False), ("forward_backward", True)):
                for name, fn in fns.items():  # memory (accounting slows the op dispatch: untimed)
                    _, extra, extra_grad = run_once(fn, case["logits"], backward, measure=True)
                    res[name][mode_key] = {"peak_over_logits": round(extra / logits_bytes, 3),
                                           "peak_over_logits_with_grad": round(extra_grad / logits_bytes, 3)}
                with HostReads() as reads:  # eager only: a dispatch mode would change what torch.compile traces
                    run_once(fns["new_eager"], case["logits"], backward, measure=False)
                res["new_eager"][mode_key]["host_reads"] = reads.total
                times: dict[str, list[float]] = {name: [] for name in fns}
                for name, fn in fns.items():  # warm-up
                    run_once(fn, case["logits"], backward, measure=False)
                for _ in range(repeats):  # interleaved
                    for name, fn in fns.items():
                        times[name].append(run_once(fn, case["logits"], backward, measure=False)[0])
                for name in fns:
                    res[name][mode_key]["ms"] = round(1e3 * statistics.median(times[name]), 2)
            for name in ("new", "new_eager", "new_logprob_only"):
                res[name]["time_vs_plain"] = round(res[name]["forward_backward"]["ms"] / res["plain"]["forward_backward"]["ms"], 3)
                res[name]["forward_time_vs_plain"] = round(res[name]["forward"]["ms"] / res["plain"]["forward"]["ms"], 3)
            out[f"G={g}"] = out.get(f"G={g}", {})
            out[f"G={g}"][support_key] = res
            print(json.dumps({f"G={g}": {support_key: res}}), file=sys.stderr, flush=True)  # progress on a loaded machine
        del case
        gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON result only")
    ap.add_argument("--g", default="64,256", help="comma-separated numbers of scored rows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    t0 = time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "V": V,
        "logits_dtype": "bfloat16",
        "temperature": args.temperature,
        "support_kept_per_row": f"1-{MAX_KEPT}",
        "memory_method": ("peak of CUDA's caching allocator (max_memory_allocated, reset before the call) minus what "
                          "was allocated before it, minus the logits' gradient, over the bf16 logits' bytes")
        if DEVICE == "cuda" else ("peak of the CPU allocator's allocations minus frees during the call (torch.profiler "
                          "profile_memory events; compiled code included), minus the logits' gradient (logits-sized, "
                          "every path returns it; counted in peak_over_logits_with_grad), over the bf16 logits' bytes"),
        "backend_auto": "torch_compiled on CPU at these sizes (moe_replay.replay.scoring.COMPILE_MIN_ELEMENTS)"
        if DEVICE == "cpu" else "the backend score_logits picks for CUDA tensors",
        "time_method": f"median of {args.repeats} interleaved runs after one warm-up each",
        "results": bench([int(x) for x in args.g.split(",")], args.repeats, args.temperature),
    }
    result["compile_s"] = result["results"].pop("compile_s")
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=None if args.json else 2))
    if OWN_CACHE is not None:
        shutil.rmtree(OWN_CACHE, ignore_errors=True)


if __name__ == "__main__":
    main()
