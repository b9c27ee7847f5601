"""verl's actor steps in one process: the glue of `RayPPOTrainer` and `TrainingWorker`, without Ray.

`build_engine` is the actor engine a `TrainingWorker` builds (verl's EngineRegistry, with
moe_replay's engine installed), on verl's CPU platform (cpu.py) at world size 1;
`old_log_prob` is `RayPPOTrainer._compute_old_log_prob` + `TrainingWorker.infer_batch`;
`update_actor` is `RayPPOTrainer._update_actor` + `TrainingWorker.train_mini_batch` /
`train_batch` with verl's `ppo_loss`. Each converts verl's DataProto with verl's own functions
(`to_tensordict`, `left_right_2_no_padding`, `no_padding_2_padding`) and calls the engine's
`infer_batch` / `train_batch`, so the engine sees exactly the TensorDicts verl's workers hand it.
The Ray layer itself (worker groups, dispatch) is what this leaves out.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch

from ..vllm.weights import update_weights
from .cpu import use_cpu
from .registry import install, without_trl_value_head


def build_engine(model_dir: str, preset: str | None, *, micro_batch_size: int = 4, lr: float = 1e-3,
                 engine_overrides: dict | None = None, model_overrides: dict | None = None) -> Any:
    """verl's FSDP2 actor engine for `model_dir` in this process (world size 1, gloo), under `preset`.

    The config is what a verl user sets (model.override_config.moe_replay; use_remove_padding off
    unless `model_overrides` turn it on),
    built with verl's own dataclasses; the engine comes from verl's EngineRegistry, where
    `registry.install()` put moe_replay's. FSDP1 (`strategy=fsdp`) stops on CPU: it syncs module
    states from rank 0, which torch allows only for parameters on a GPU.
    """
    use_cpu()
    if not torch.distributed.is_initialized():
        _init_one_rank_group()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    install()
    override = {"attn_implementation": "sdpa"}  # verl defaults to flash-attention 2, which has no CPU build
    if preset is not None:
        override["moe_replay"] = preset
    model_kw = {"path": str(model_dir), "use_remove_padding": False, "override_config": override, **(model_overrides or {})}
    model_config = HFModelConfig(**model_kw)
    model_config.model_type = "language_model"
    engine_kw = {"strategy": "fsdp2", "model_dtype": "fp32", "use_torch_compile": False,  # verl's default precision: bf16 mixed
                 "use_remove_padding": model_config.use_remove_padding, "use_dynamic_bsz": False,
                 "micro_batch_size_per_gpu": micro_batch_size, "infer_micro_batch_size_per_gpu": micro_batch_size,
                 "seed": 0, **(engine_overrides or {})}
    engine = EngineRegistry.new(model_type="language_model", backend="fsdp2", model_config=model_config,
                                engine_config=FSDPEngineConfig(**engine_kw),
                                optimizer_config=FSDPOptimizerConfig(lr=lr, total_training_steps=1000, weight_decay=0.0),
                                checkpoint_config=CheckpointConfig())
    with without_trl_value_head():
        engine.initialize()
    return engine


def _init_one_rank_group() -> None:
    """A gloo group of world size 1: at the user's MASTER_ADDR/MASTER_PORT when set (env://), else at
    port 0 (the OS picks one; no other rank connects), never written to os.environ.

    Writing a port to os.environ outlives the call: every child this process starts inherits it
    while this group still listens there, and the child's own init_process_group fails with
    EADDRINUSE (a benchmark and a test subprocess did, after one in-process verl engine).
    """
    env = bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"))
    torch.distributed.init_process_group("gloo", init_method=None if env else "tcp://127.0.0.1:0", rank=0, world_size=1)


def _engine_keys(engine: Any, data: Any, *, train: bool) -> None:
    from verl.utils import tensordict_utils as tu

    cfg = engine.engine_config
    defaults = dict(use_remove_padding=engine.model_config.use_remove_padding, use_dynamic_bsz=cfg.use_dynamic_bsz,
                    max_token_len_per_gpu=cfg.max_token_len_per_gpu if train else cfg.infer_max_token_len_per_gpu,
                    micro_batch_size_per_gpu=cfg.micro_batch_size_per_gpu if train else cfg.infer_micro_batch_size_per_gpu,
                    use_fused_kernels=cfg.use_fused_kernels)
    for key, val in defaults.items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: val})


def old_log_prob(engine: Any, batch: Any, *, temperature: float = 1.0) -> tuple[Any, dict]:
    """(DataProto with old_log_probs / entropys [B, R], the engine's metrics) as verl's π_old pass."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    batch.meta_info["temperature"] = temperature
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    _engine_keys(engine, td, train=False)
    with engine.eval_mode():
        out = engine.infer_batch(td, loss_function=None)
    logp = no_padding_2_padding(out["model_output"]["log_probs"], td)
    ent = no_padding_2_padding(out["model_output"]["entropy"], td)
    return DataProto.from_dict(tensors={"old_log_probs": logp.float(), "entropys": ent.float()}), out["metrics"]


def update_actor(engine: Any, batch: Any, *, temperature: float = 1.0, actor_overrides: dict | None = None) -> dict:
    """One update of the actor on `batch` (one mini-batch, one epoch) with verl's ppo_loss; verl's metrics."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    batch.meta_info["temperature"] = temperature
    td = left_right_2_no_padding(batch.to_tensordict())
    size = len(batch)
    tu.assign_non_tensor(td, calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=size, compute_loss=True, update_lr_scheduler=False)
    _engine_keys(engine, td, train=True)
    config = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=size, ppo_micro_batch_size_per_gpu=engine.engine_config.micro_batch_size_per_gpu,
                         use_dynamic_bsz=False, rollout_n=1, **(actor_overrides or {}))
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=partial(ppo_loss, config))
    return {**out["metrics"], "loss": float(sum(out["loss"]))}


def advantages_from_rewards(batch: Any, rewards_B: torch.Tensor) -> None:
    """Token-level advantages = each sample's reward minus the batch mean, on its response tokens."""
    adv_B = (rewards_B - rewards_B.mean()).float()
    mask = batch.batch["response_mask"]
    batch.batch["advantages"] = adv_B[:, None] * mask


def sync_weights(engine: Any, llm: Any, model_dir: str, out_dir: str) -> Any:
    """The actor's weights into the vLLM engine (verl's `update_weights` role, through a checkpoint dir).

    verl's colocated sync streams `engine.get_per_tensor_param()` into its rollout server; here the
    same tensors are saved next to the checkpoint's config and tokenizer and loaded with
    moe_replay's `update_weights` (which also repacks vLLM-CPU's MoE kernels and drops caches).
    """
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    params, _ = engine.get_per_tensor_param()
    state = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in params}
    save_file(state, str(out / "model.safetensors"))
    return update_weights(llm, out)
