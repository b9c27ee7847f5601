"""Score rollouts' generated tokens with an HF causal LM (a BatchScorer for the π_old estimator).

Batches are right-padded; position p's logits score token p+1. In bf16 on a GPU the padding and
batch composition change the kernels' reduction order, which is real engine-like noise; in fp32
on CPU scoring is deterministic.

Legend: B batch, S padded length, V vocab, G generated tokens of one rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from moe_replay.trace import RolloutTrace


@dataclass(frozen=True)
class HFScorerConfig:
    model_dir: str
    """A local HF checkpoint directory."""
    dtype: str = "float32"
    """torch dtype name of the model weights and compute."""
    device: str = "cpu"
    renormalise_support: bool = False
    """Score over each token's recorded sampling support (traces must carry it)."""

    def __post_init__(self) -> None:
        if not Path(self.model_dir).is_dir():
            raise ValueError(f"HFScorerConfig.model_dir: expected a checkpoint directory, found {self.model_dir!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"HFScorerConfig.dtype must be float32/bfloat16/float16, got {self.dtype!r}")


class HFScorer:
    """`score_batch(traces) -> [logprobs_G]`, one forward per batch."""

    def __init__(self, config: HFScorerConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.config = config
        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=getattr(torch, config.dtype))
        self.model.to(config.device).eval()

    def score_batch(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        torch = self._torch
        if not traces:
            return []
        lens = [t.num_tokens for t in traces]
        ids_BS = torch.zeros(len(traces), max(lens), dtype=torch.long)
        mask_BS = torch.zeros_like(ids_BS)
        for b, t in enumerate(traces):
            ids_BS[b, : lens[b]] = torch.from_numpy(t.token_ids_S)
            mask_BS[b, : lens[b]] = 1
        with torch.no_grad():
            logits_BSV = self.model(input_ids=ids_BS.to(self.config.device), attention_mask=mask_BS.to(self.config.device)).logits
        out = []
        for b, t in enumerate(traces):
            logits_GV = logits_BSV[b, t.prompt_len - 1 : lens[b] - 1].float()
            if self.config.renormalise_support:
                logits_GV = _mask_to_support(logits_GV, t)
            logp_GV = torch.log_softmax(logits_GV, dim=-1)
            target_G = torch.from_numpy(t.token_ids_S[t.prompt_len :]).to(logp_GV.device)
            out.append(logp_GV.gather(1, target_G[:, None])[:, 0].double().cpu().numpy())
        return out


def _mask_to_support(logits_GV, trace: RolloutTrace):
    import torch

    if trace.support is None:
        raise ValueError(f"rollout {trace.key!r}: renormalise_support=True but the trace has no sampling support")
    sup = trace.support
    keep_GV = torch.zeros_like(logits_GV, dtype=torch.bool)
    rows = torch.from_numpy(np.repeat(np.arange(sup.num_rows), sup.sizes_G()))
    keep_GV[rows, torch.from_numpy(sup.ids_N.astype(np.int64))] = True
    return logits_GV.masked_fill(~keep_GV, float("-inf"))
