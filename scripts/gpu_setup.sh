#!/usr/bin/env bash
# On the GPU machine: install the vLLM that scripts/gpu_pack.sh packed (its parts copied to /tmp/w by
# the earlier transfers) into /tmp/site, and make this checkout importable as the installed package
# would be (moe_replay.integrations <- integrations/, moe_replay.configs <- configs/, and the
# vllm.general_plugins entry point that binds capture at model load) under /tmp/mr.
# GPU_MR_ONLY=1: the package layout only (before every part has arrived: torch-only steps can run).
# Then: export PYTHONPATH=/tmp/site:/tmp/mr VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
w=${GPU_PARTS:-/tmp/w}
site=${GPU_SITE:-/tmp/site}
mr=${GPU_MR:-/tmp/mr}
t0=$(date +%s)
if [ -z "${GPU_MR_ONLY:-}" ] && [ ! -f "$site/vllm/__init__.py" ]; then
  cat "$w"/part.* > "$w/pack.tar"
  mkdir -p "$w/pack" "$site"
  tar -C "$w/pack" -xf "$w/pack.tar"
  python3 -m pip install -q --no-index --no-deps --no-compile ${GPU_PIP_ARGS:-} --target "$site" "$w"/pack/deps/*.whl
  python3 -m zipfile -e "$w/pack/vllm-stripped.zip" "$site"
fi
rm -rf "$mr" && mkdir -p "$mr"
cp -r "$root/moe_replay" "$mr/moe_replay"
cp -r "$root/integrations" "$mr/moe_replay/integrations"
cp -r "$root/configs" "$mr/moe_replay/configs"
python3 - "$root/pyproject.toml" "$mr" <<'PY'
import sys, tomllib, pathlib
proj = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"]
d = pathlib.Path(sys.argv[2]) / f"moe_replay-{proj['version']}.dist-info"
d.mkdir()
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: moe_replay\nVersion: {proj['version']}\n")
lines = []
for group, eps in proj.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{k} = {v}" for k, v in eps.items()]
    lines.append("")
(d / "entry_points.txt").write_text("\n".join(lines))
PY
echo "gpu_setup: done in $(( $(date +%s) - t0 )) s"
