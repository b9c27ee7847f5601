"""The oldest transformers the README claims still replays what the newest does.

The venv runs the newest transformers (scripts/bootstrap.py's TRANSFORMERS, what every other test
uses); bootstrap installs the oldest claimed release (TRANSFORMERS_OLDEST) into its own folder
beside the venv. Here a fresh interpreter puts that folder first on its path and re-runs the fp32
coverage check for every family docs/hf_coverage.md marks replayed that the old release also ships:
each must replay there too, or the claimed range is wrong.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_replay.integrations.hf import coverage

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "hf_coverage.md"
SLOW = {"kimi_linear", "afmoe", "granitemoehybrid"}
"""Torch reference kernels (linear attention, mamba): 45-130 s each on a loaded 2-core CPU; the newest release's rows cover them."""
OLDER_STRUCTURE = {"jamba": "inline"}
"""Families whose modeling the oldest release structures otherwise, refused there by name (the reason names the
word): 5.19's JambaSparseMoeBlock routes inline (a Linear and route_tokens_to_experts, no router module)."""

_CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
from moe_replay.integrations.hf.coverage import moe_families, run_all
wanted = json.loads(sys.argv[1])
known = moe_families()
results = run_all({f: known[f] for f in wanted if f in known}, ["fp32"])
print(json.dumps({"transformers": transformers.__version__, "transformers_file": transformers.__file__,
                  "missing": sorted(set(wanted) - set(known)),
                  "status": {r.family: [r.status, r.reason] for r in results["fp32"]}}))
"""


def _bootstrap():
    spec = importlib.util.spec_from_file_location("_bootstrap", ROOT / "scripts" / "bootstrap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_oldest_claimed_transformers_replays_the_newest_families():
    boot = _bootstrap()
    folder = boot.compat_dir(Path(sys.prefix))
    if not (folder / "transformers").is_dir():
        pytest.fail(f"transformers {boot.TRANSFORMERS_OLDEST} expected in {folder} (scripts/bootstrap.py installs it); found nothing")
    wanted = sorted(set(coverage.claimed(str(TABLE), "fp32")) - SLOW)
    assert len(wanted) >= 40, f"docs/hf_coverage.md claims only {len(wanted)} families in fp32"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(wanted)], capture_output=True, text=True, env=env,
                          timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["transformers"] == boot.TRANSFORMERS_OLDEST and out["transformers_file"].startswith(str(folder)), out
    older = {f: out["status"].pop(f) for f in OLDER_STRUCTURE if f in out["status"]}
    for family, status in older.items():
        assert status[0] == "refused" and OLDER_STRUCTURE[family] in status[1], (family, status)
    not_replayed = {f: s for f, s in out["status"].items() if s[0] != "replayed"}
    assert not not_replayed, f"on transformers {out['transformers']}: {not_replayed}"
    # families new since the oldest release are the newest's alone; the rest must all have run
    assert len(out["status"]) + len(out["missing"]) + len(older) == len(wanted)
