"""The rollout side of the demo: a real in-process vLLM engine with capture, and weight sync.

Weights go trainer -> engine every step in place (`integrations.vllm.weights.update_weights`:
vLLM's `reload_weights` from a `save_pretrained` directory, which the tiny model writes in ~15 ms,
plus the CPU MoE repack vLLM 0.32 misses); the prefix cache is reset after each sync. vLLM's
routine lines of each sync and of the first load (weights.EXPECTED_SYNC_LOGS) and transformers'
save progress bar are left out of the console unless MOE_REPLAY_VERBOSE=1 (`demo --verbose`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..models.prompts import ArithmeticProblem
from ..trace import RolloutTrace
from .config import DemoConfig


def _set_vllm_env() -> None:
    # before vLLM is imported: engine core in this process, a small CPU KV cache
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@contextlib.contextmanager
def _no_save_progress_bar() -> Iterator[None]:
    """transformers' "Writing model shards" bar off around the demo's own saves: one line a sync,
    48 in a default run (MOE_REPLAY_VERBOSE=1 keeps it)."""
    from transformers.utils import logging as hf_logging

    from ..expected_logs import verbose

    if verbose() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


class RolloutEngine:
    def __init__(self, model_dir: Path, cfg: DemoConfig, max_batch_seqs: int) -> None:
        _set_vllm_env()
        from vllm import LLM

        from ..expected_logs import expected_logs
        from ..integrations.vllm import CaptureConfig, VllmCapture, capture_engine_kwargs
        from ..integrations.vllm.weights import EXPECTED_SYNC_LOGS

        self.cfg, self.model_dir = cfg, Path(model_dir)
        with expected_logs(EXPECTED_SYNC_LOGS):  # the fp32 checkpoint's first load into the bf16 engine
            self.llm = LLM(**capture_engine_kwargs(
                model=model_dir, dtype=cfg.engine_dtype, enforce_eager=True, max_model_len=256,
                max_num_seqs=max_batch_seqs, max_num_batched_tokens=4096, seed=cfg.seed,
                distributed_executor_backend="uni", enable_prefix_caching=False,
            ))
        # capture everything in every arm: the 'none' arm needs routes and support for its metrics
        self.capture = VllmCapture(self.llm, CaptureConfig(routes=True, support=True, logprobs=True))
        self.tokenizer = self.llm.get_tokenizer()

    def rollout(self, problems: Sequence[ArithmeticProblem], step: int,
                samples: int | None = None) -> tuple[list[RolloutTrace], list[list[str]]]:
        """n samples per problem (`samples`, else the config's); traces and completions in (problem, sample) order."""
        from vllm import SamplingParams

        sp = SamplingParams(n=samples or self.cfg.samples_per_prompt, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                            max_tokens=self.cfg.max_tokens, seed=self.cfg.seed * 7919 + step)
        outputs, traces = self.capture.generate([p.prompt for p in problems], sp, use_tqdm=False)
        completions = [[c.text for c in out.outputs] for out in outputs]
        return traces, completions

    def load_weights(self, weights_dir: Path) -> None:
        from ..integrations.vllm.weights import update_weights

        update_weights(self.llm, weights_dir)

    def sync_from(self, model: Any, sync_dir: Path) -> None:
        with _no_save_progress_bar():
            model.save_pretrained(sync_dir)
        self.load_weights(sync_dir)

    def shutdown(self) -> None:
        try:
            self.capture.uninstall()
        finally:
            self.llm.llm_engine.engine_core.shutdown()
