"""Rollouts on SGLang -> a trace store -> Megatron-core replays their routes -> loss and backward.

    python -m sglang.launch_server --model-path MODEL --enable-return-routed-experts ...   # SGLang's own venv
    python examples/sglang_megatron.py --url http://127.0.0.1:30000 --store /tmp/sglang-traces

The client is plain HTTP (SGLang's `/generate` with `return_routed_experts` and `return_sampling_mask`), so
it runs in the trainer's environment. The Megatron model here is a fresh GPTModel with the served model's
MoE geometry (layers, experts, top-k, vocabulary), standing in for the trainer's: replay forces the
experts SGLang recorded at every token and layer, and the loss is scored over SGLang's kept sets. On a
CPU, Megatron-core needs a gloo group and three shims (below); a GPU trainer has neither.
"""

import argparse
import socket
import tempfile

import torch

import moe_replay
from moe_replay.integrations.sglang import SglangCapture
from moe_replay.store import DirectoryStore

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--url", required=True, help="a running SGLang server started with --enable-return-routed-experts")
ap.add_argument("--model-dir", default=None, help="its checkpoint, when the server's model path is not readable here")
ap.add_argument("--store", default=None, help="the trace store's directory (default: a temporary one)")
args = ap.parse_args()

# 1. rollouts on SGLang, captured into a store (each prompt's 2 samples share their prompt's routes there)
cap = SglangCapture(args.url, model=args.model_dir)
store_dir = args.store or tempfile.mkdtemp() + "/traces"
with DirectoryStore(store_dir) as store:
    _, traces = cap.generate(["the cat route token model", "expert layer sample alpha beta"],
                             {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "max_new_tokens": 12, "n": 2}, store=store)
g = cap.geometry
print(f"sglang: {len(traces)} traces of {g.family} ({g.num_moe_layers} MoE layers, {g.num_experts} experts, "
      f"top-{g.top_k}) in {store_dir}")

# 2. Megatron-core on CPU: one gloo rank, Megatron's parallel state, and the CPU shims its CUDA calls need
import megatron.core.tensor_parallel.random as mrandom  # noqa: E402
import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

torch.cuda.current_device = lambda: "cpu"
moe_utils.te_general_gemm = None
mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
mrandom._set_cuda_rng_state = lambda *a, **k: None
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
mrandom.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)  # CPU RNG states (the shims above)

cfg = TransformerConfig(num_layers=g.num_layers, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                        moe_ffn_hidden_size=64, num_moe_experts=g.num_experts, moe_router_topk=g.top_k,
                        moe_layer_freq=[int(i in g.moe_layer_ids) for i in range(g.num_layers)],
                        moe_enable_routing_replay=True, moe_router_pre_softmax=False, use_cpu_initialization=True,
                        moe_router_dtype="fp32", add_bias_linear=False, moe_token_dispatcher_type="allgather")
torch.manual_seed(0)
model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), vocab_size=g.vocab_size,
                 max_sequence_length=256).train()

# 3. replay the stored rollouts in Megatron: loss over SGLang's kept sets, backward through the routers
mr = moe_replay.enable("r3_support", model=model, family=g.family)
with DirectoryStore(store_dir, readonly=True) as store:
    stored = store.get_many([t.key for t in traces])
with mr.train_batch(stored) as batch:
    logprobs_G = batch.logprobs(model(**batch.model_inputs()))
    loss = -logprobs_G.mean()
    loss.backward()
routers = [m for n, m in model.named_modules() if type(m).__name__ == "TopKRouter"]
grad = sum(float(r.weight.grad.norm()) for r in routers)
routed = int(batch.plan.routed_N.sum())
# every router call was checked to route exactly the recorded experts (else the forward fails by name)
print(f"megatron: path {batch.session.path} ({batch.session.path_reason}); {len(routers)} routers replayed "
      f"{routed} recorded positions each")
print(f"loss {loss.item():.4f} over {len(logprobs_G)} tokens; router grad norm {grad:.4f}; "
      f"max |megatron - sglang| logprob {float((logprobs_G.detach().double() - batch.rollout_logprobs).abs().max()):.3f} "
      "(another model's weights)")
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
