"""The engine-side sparse support scorer (replay.scoring.engine_support_logprobs) against a dense
float64 reference: kept-set renormalisation, per-row temperature (0 = greedy, unscaled), rows
without a support scored over V, a target outside its kept set at -inf for that row only."""

from __future__ import annotations

import numpy as np
import torch

from moe_replay.replay.scoring import SupportCSR, engine_support_logprobs


def _dense(x_GV, target_G, kept, temp_G):
    out = []
    for g in range(len(target_G)):
        t = float(temp_G[g]) if float(temp_G[g]) > 0 else 1.0
        row = x_GV[g].double() / t
        if kept[g] is None:
            out.append(float(torch.log_softmax(row, -1)[target_G[g]]))
            continue
        ids = torch.tensor(kept[g])
        if int(target_G[g]) not in kept[g]:
            out.append(float("-inf"))
            continue
        out.append(float(row[target_G[g]] - torch.logsumexp(row[ids], -1)))
    return np.array(out)


def test_matches_the_dense_reference_row_by_row():
    gen = torch.Generator().manual_seed(0)
    G, V = 7, 50
    x_GV = torch.randn(G, V, generator=gen) * 3
    target_G = torch.randint(0, V, (G,), generator=gen)
    kept = []
    for g in range(G):
        if g == 2:
            kept.append(None)  # no support recorded: the whole vocabulary
            continue
        ids = set(torch.randperm(V, generator=gen)[: 5 + g].tolist()) | ({int(target_G[g])} if g != 4 else set())
        ids.discard(int(target_G[g])) if g == 4 else None  # row 4: the target is outside its kept set
        kept.append(sorted(ids))
    temp_G = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 2.0, 1.0])
    kept[3] = [int(target_G[3])]  # greedy row: the argmax alone
    sizes = [0 if k is None else len(k) for k in kept]
    off = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.long)
    ids_N = torch.tensor([i for k in kept if k is not None for i in k], dtype=torch.long)
    got = engine_support_logprobs(x_GV, target_G, SupportCSR(off, ids_N), temp_G).numpy()
    want = _dense(x_GV, target_G, kept, temp_G)
    assert np.isneginf(got[4]) and np.isfinite(np.delete(got, 4)).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got[3] == 0.0
    # bf16 logits are scored in fp32, like the engine's own rows
    got16 = engine_support_logprobs(x_GV.bfloat16(), target_G, SupportCSR(off, ids_N), temp_G).numpy()
    np.testing.assert_allclose(got16, _dense(x_GV.bfloat16().float(), target_G, kept, temp_G), rtol=1e-5, atol=1e-5)
