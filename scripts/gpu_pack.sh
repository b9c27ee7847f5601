#!/usr/bin/env bash
# Pack vLLM 0.26 (GPU build) for the offline GPU machine in as few < 64 MiB transfers as possible.
#
# ../shared/tools/gpu-vllm-prepare downloads the wheel and its missing dependencies into
# $GPU_VLLM_CACHE (default /tmp/gpu-vllm-wheels) and splits them into six folders. Two files of the
# 303 MB wheel are never loaded on a Hopper GPU serving a bf16 model: FlashAttention 2's kernels
# (_vllm_fa2_C, 130 MB compressed; vLLM picks FA3 on SM90 and imports FA2 under try/except) and the
# Rust front-end binary vllm-rs (16 MB; used only with VLLM_RUST_FRONTEND_PATH). Without them the
# wheel and the dependencies fit in four transfers instead of six: each transfer is a `run` call,
# and every call's start and copy is paid from the session's 15 minutes of device time.
#
# Usage (project root): ../shared/tools/gpu-vllm-prepare && scripts/gpu_pack.sh
# Then, on the GPU machine, scripts/gpu_setup.sh reassembles, installs into /tmp/site and makes the
# project importable (with its vllm.general_plugins entry point).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
cache=${GPU_VLLM_CACHE:-/tmp/gpu-vllm-wheels}
whl="$cache/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
[ -f "$whl" ] || { echo "missing $whl: run ../shared/tools/gpu-vllm-prepare first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$whl" "$work/vllm.zip"
# zip -d is not everywhere; Python's zipfile rewrites the archive without the two members.
python3 - "$work/vllm.zip" "$work/vllm-stripped.zip" <<'PY'
import sys, zipfile
drop = {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs"}
with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], "w") as dst:
    for info in src.infolist():
        if info.filename in drop:
            continue
        dst.writestr(info, src.read(info.filename), compress_type=info.compress_type)
PY
mkdir -p "$work/pack/deps"
mv "$work/vllm-stripped.zip" "$work/pack/"
cp "$cache"/deps/*.whl "$work/pack/deps/"
tar -C "$work/pack" -cf "$work/pack.tar" .
split -b 60000000 -d -a 1 "$work/pack.tar" "$work/part."
for d in .gpu-c1 .gpu-c2 .gpu-c3 .gpu-c4 .gpu-c5 .gpu-c6; do rm -rf "$d"; done
n=0
for p in "$work"/part.*; do
  n=$((n + 1))
  mkdir -p ".gpu-p$n"
  grep -qx "/.gpu-p$n/" .git/info/exclude 2>/dev/null || echo "/.gpu-p$n/" >> .git/info/exclude
  mv "$p" ".gpu-p$n/"
done
echo "packed into $n folders: $(ls -d .gpu-p* | tr '\n' ' ')"
