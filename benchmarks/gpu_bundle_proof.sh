#!/usr/bin/env bash
# The GPU bundle's install path proven on a CPU (issue 66): a fresh Python 3.12 environment holding only what the GPU
# image holds (torch and its stack, numpy, pandas, matplotlib, seaborn, pyarrow, scipy: PREINSTALLED in
# benchmarks/gpu_bundle.py, at this checkout's versions), then, with the network cut off (`unshare -n`, needs root),
# `bash benchmarks/gpu_check.sh OUT --device cpu --tiny --suite-report`: it unpacks gpu_bundle/site.tar.xz and runs
# the check's parts at the tiny size, the suite's own commands included (sft, train with an MLflow store, figure 1 and
# REPORT.md at the gpu scale from those runs, make reproduce-figure-1 SCALE=smoke).
#   bash benchmarks/gpu_bundle_proof.sh [ENV_DIR] [OUT_DIR]       # after make gpu-bundle
set -euo pipefail
cd "$(dirname "$0")/.."
env=${1:-/tmp/gspo-gpu-image-py312}
out=${2:-results/gpu_bundle_proof}
py312=${PY312:-}
for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python; do  # the first that runs
    [ -n "$py312" ] || ! "$c" --version >/dev/null 2>&1 || py312=$c
done
[ -n "$py312" ] || { echo "error: no Python 3.12 here (set PY312)" >&2; exit 2; }
[ -f gpu_bundle/site.tar.xz ] || { echo "error: no gpu_bundle/site.tar.xz (make gpu-bundle)" >&2; exit 2; }
if [ ! -f "$env/.image-done" ]; then  # built whole or built again
    rm -rf "$env"
    "$py312" -m venv "$env"
    image=$(.venv/bin/python -m benchmarks.gpu_bundle --image)
    "$env/bin/python" -m pip install -q $image  # torch from the package index: its CUDA build, run here on the CPU
    touch "$env/.image-done"
fi
"$env/bin/python" -c "import torch, sys; print('image:', sys.version.split()[0], 'torch', torch.__version__)"
rm -rf "$out"
unshare -n env PYTHON="$env/bin/python" PATH="$env/bin:$PATH" bash benchmarks/gpu_check.sh "$out" --device cpu --tiny --suite-report
