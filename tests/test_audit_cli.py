"""`moe-replay audit MODEL ROUTES`: a trace store, vLLM and SGLang outputs as JSON Lines, verl's batch as
.npz; exit status 0 when the routes line up, 1 when they do not (the verdict printed), 2 on bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_replay.audit.zoo import FAULTS, Sample, inject, write
from moe_replay.cli import main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def setup(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.hf import model_geometry, self_routed_trace

    path = tiny_model("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    traces = [self_routed_trace(model, rng.integers(3, 500, 20), 6, f"k{i}") for i in range(4)]
    samples = [Sample(t.key, t.token_ids_S, t.routes_TLK.astype(np.int64)) for t in traces]
    return path, traces, samples, model_geometry(model)


def _jsonl(tmp_path, routes, tokens, kw, name):
    out = tmp_path / name
    starts = kw.get("prompt_start", kw.get("start_len", 0))
    key = "routed_experts_prompt_start" if "prompt_start" in kw else "routed_experts_start_len"
    with out.open("w") as f:
        for r, t, k in zip(routes, tokens, kw["keys"]):
            f.write(json.dumps({"key": k, "token_ids": t.tolist(), "routed_experts": r if isinstance(r, str) else r.tolist(),
                                key: starts}) + "\n")
    return out


def test_a_store_lines_up(setup, tmp_path, capsys):
    from moe_replay.store import DirectoryStore

    path, traces, _, _ = setup
    with DirectoryStore(tmp_path / "store", durable=False) as store:
        store.put_many(traces)
    assert main(["audit", str(path), str(tmp_path / "store"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["format"] == "trace" and len(report["samples"]) == 4
    assert report["thresholds"]["aligned"] == 0.8


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_engine_outputs_as_json_lines(setup, tmp_path, capsys, fmt):
    path, _, samples, g = setup
    good = _jsonl(tmp_path, *write(samples, fmt, g), f"good.{fmt}.jsonl")
    assert main(["audit", str(path), str(good)]) == 0
    assert "aligned" in capsys.readouterr().out
    late = _jsonl(tmp_path, *inject(FAULTS["shift_forward"], samples, fmt, g), f"late.{fmt}.jsonl")
    assert main(["audit", str(path), str(late), "--dtype", "bfloat16"]) == 1
    out = capsys.readouterr().out
    assert f"routes ({fmt}, 4 samples" in out and "shifted by +1 tokens" in out and "thresholds: aligned=0.8" in out


def test_verl_batch_as_npz(setup, tmp_path, capsys):
    path, _, samples, g = setup
    routes, ids, kw = inject(FAULTS["other_sample"], samples, "verl", g)
    np.savez(tmp_path / "batch.npz", routed_experts=routes.numpy(), input_ids=ids.numpy(),
             attention_mask=kw["attention_mask"].numpy())
    assert main(["audit", str(path), str(tmp_path / "batch.npz"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"]["cause"] == "other_sample" and report["format"] == "verl"


def test_bad_input_exits_2_naming_it(setup, tmp_path, capsys):
    path, *_ = setup
    assert main(["audit", str(path), str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"token_ids": [1, 2, 3]}\n')
    assert main(["audit", str(path), str(bad)]) == 2
    assert "routed_experts" in capsys.readouterr().err
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"token_ids": [5, 6, 7], "routed_experts": "AAAA", "routed_experts_start_len": 0}) + "\n")
    assert main(["audit", str(path), str(odd)]) == 2
    assert "a multiple of" in capsys.readouterr().err
