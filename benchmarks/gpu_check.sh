#!/usr/bin/env bash
# The GPU check on a machine with Python, torch and a CUDA driver (`make gpu-check`, or the device tool):
#   bash benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options...]
# If that Python lacks what the check imports (transformers >= 5.24, omegaconf, tokenizers, ...), the wheels
# of gpu_bundle/ (`make gpu-bundle`, built on a networked machine) are installed into a temporary folder
# first, no network needed; torch is never installed. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options]}
shift
py=${PYTHON:-python3}
bundle=${GPU_BUNDLE:-gpu_bundle}
has_deps() {
    "$py" - <<'PY'
import importlib.metadata as m, sys
try:
    ok = tuple(int(x) for x in m.version("transformers").split(".")[:2]) >= (5, 24)
    for name in ("omegaconf", "tokenizers", "safetensors", "yaml", "tqdm", "filelock"):
        __import__(name)
except Exception:
    ok = False
sys.exit(0 if ok else 1)
PY
}
if ! has_deps; then
    ls "$bundle"/*.whl >/dev/null 2>&1 || { echo "error: $py lacks the check's packages and $bundle/ holds no wheels (make gpu-bundle)" >&2; exit 2; }
    site=$(mktemp -d /tmp/gspo-gpu-site.XXXXXX)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$bundle"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed $(ls "$bundle"/*.whl | wc -l) wheels from $bundle/ into $site"
fi
PYTHONUNBUFFERED=1 exec "$py" -m benchmarks.gpu_check --out "$out" "$@"
