"""The end-to-end demo: GRPO on a toy arithmetic task, real vLLM rollouts (bf16) and HF training
(fp32), three arms (no fix; R3 + support; R3 + support + multi-sample π_old), then the multi-sample
π_old under the engine-noise instrument (noisy.py; `DemoConfig(noise=None)` skips it), one report.

Imports vLLM/transformers lazily; `run_demo(DemoConfig(), out_dir)` does everything.
"""

from .config import DEFAULT_ARMS, DemoConfig, NoiseSection
from .loop import check_presets, run_demo

__all__ = ["DEFAULT_ARMS", "DemoConfig", "NoiseSection", "check_presets", "run_demo"]
