"""The GPU go's scripts, rehearsed without a GPU: the driver runs each step's plan, parses what the steps
print and records failures and time-outs per step; gpu_trainer.py runs its checks over gloo on the CPU
(the same code the GPU runs over NCCL); gpu_setup.sh lays the checkout out as the installed package."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_last_json_takes_the_last_object_after_engine_logs():
    drv = _load("gpu_driver")
    text = 'INFO engine up\n{"partial": 1}\nWARNING x\n{"a": 1, "b": [2]}\n'
    assert drv.last_json(text) == {"a": 1, "b": [2]}
    assert drv.last_json('log line\n{\n "plan": 1\n}\n') == {"plan": 1}
    assert drv.last_json("no json here\n") is None


def test_driver_records_each_step_and_survives_failures(tmp_path, monkeypatch):
    drv = _load("gpu_driver")
    ok = drv.Step("ok", (sys.executable, "-c", "print('noise'); print('{\"x\": 3}')"), (), 30)
    bad = drv.Step("bad", (sys.executable, "-c", "import sys; sys.exit('boom')"), (), 30)
    slow = drv.Step("slow", (sys.executable, "-c", "import time; time.sleep(30)"), (), 1)
    monkeypatch.setattr(drv, "STEPS", (ok, bad, slow))
    monkeypatch.setattr(drv, "NAMES", ("ok", "bad", "slow"))
    assert drv.main(["--out", str(tmp_path), "--steps", "ok,bad,slow", "--budget-s", "60"]) == 0
    res = json.loads((tmp_path / "gpu-results.json").read_text())
    assert res["ok"]["rc"] == 0 and res["ok"]["result"] == {"x": 3}
    assert res["bad"]["rc"] == 1 and "boom" in res["bad"]["stderr_tail"]
    assert res["slow"]["timed_out"] is True and res["slow"]["rc"] is None
    assert "===== bad" in (tmp_path / "gpu-log.txt").read_text()


def test_driver_plans_the_gpu_steps(tmp_path):
    """Each GPU step's own --plan parses here (the capture step's dry run: tests/test_gpu_capture_bench.py)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_driver.py"), "--plan", "--out", str(tmp_path),
                          "--steps", "trainer,estimator,estimator_core"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "gpu-results.json").read_text())
    assert res["trainer"]["result"]["modes"] == ["fsdp2_bf16", "fsdp2_autocast_bf16"]
    assert res["estimator"]["result"]["quick"] is True and res["estimator"]["result"]["core"] == "inproc"
    assert res["estimator_core"]["result"]["core"] == "process" and res["estimator_core"]["result"]["ratio_only"] is True


@pytest.mark.slow
@pytest.mark.hf
def test_gpu_trainer_checks_run_over_gloo_on_cpu():
    """The trainer step's own code on the CPU: FSDP2-sharded replay bit-identical in both modes, and a
    replayed forward + backward with finite router gradients."""
    env = {**os.environ, "MASTER_PORT": "29547"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_trainer.py"), "--device", "cpu",
                          "--families", "qwen3_moe"], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["collectives"]["collective_device"] == "cpu" and res["collectives"]["all_gather_ok"] is True
    for mode in ("fsdp2_bf16", "fsdp2_autocast_bf16"):
        row = res["hf"]["qwen3_moe"][mode]
        assert row["bit_identical"] is True and row["flips"] == 0, row
        step = res["train_step"]["qwen3_moe"][mode]
        assert step["bit_identical"] is True and step["grads_finite"] is True and step["router_grads"] > 0, step


def test_gpu_setup_lays_out_the_package(tmp_path):
    """gpu_setup.sh with vLLM already in place (its install is skipped): the checkout is importable as the
    installed package, with the vllm.general_plugins entry point vLLM loads in every engine process."""
    site, mr = tmp_path / "site", tmp_path / "mr"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    env = {**os.environ, "GPU_SITE": str(site), "GPU_MR": str(mr), "GPU_PARTS": str(tmp_path / "w")}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_setup.sh")], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    code = ("import importlib, json; from importlib.metadata import entry_points; "
            "m = importlib.import_module('moe_replay.integrations.vllm.patch'); "
            "print(json.dumps([m.__file__, sorted(e.value for e in entry_points(group='vllm.general_plugins'))]))")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(mr)}, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-2000:]
    path, plugins = json.loads(probe.stdout.strip().splitlines()[-1])
    assert path.startswith(str(mr))
    assert "moe_replay.integrations.vllm.patch:register_plugin" in plugins
