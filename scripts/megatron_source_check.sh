#!/usr/bin/env bash
# Run the Megatron tests against a megatron-core release the package registry does not serve yet
# (0.19: the registry stops at 0.16.1), from a Megatron-LM git checkout's release tag.
#
#   scripts/megatron_source_check.sh /path/to/Megatron-LM/.git core_v0.19.0
#
# megatron-core 0.19 imports triton unconditionally (megatron/core/transformer/moe/ops/paged_stash.py),
# which bootstrap never installs (no CPU backend, ~1 GB): it goes into its own folder here, on
# PYTHONPATH for this run only, like the exported megatron/core tree. Nothing in .venv changes.
set -euo pipefail
git_dir=${1:?usage: $0 MEGATRON_LM_GIT_DIR TAG}
tag=${2:-core_v0.19.0}
work=${MEGATRON_CHECK_DIR:-/tmp/megatron-${tag}}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work/src" "$work/triton"
git --git-dir="$git_dir" archive "$tag" megatron/core | tar -x -C "$work/src"
[ -d "$work/triton/triton" ] || "$root/.venv/bin/python" -m pip install -q --no-deps --target "$work/triton" triton
cd "$root"
PYTHONPATH="$work/src:$work/triton" .venv/bin/python -c "import megatron.core as m; print('megatron-core', m.__version__, m.__file__)"
PYTHONPATH="$work/src:$work/triton" .venv/bin/python -m pytest -q -p no:cacheprovider -W ignore \
  tests/test_megatron_replay.py tests/test_megatron_parallel.py tests/test_peer_megatron.py tests/test_collectives.py \
  tests/test_enable_bindings.py -k "megatron or Megatron or collective"
