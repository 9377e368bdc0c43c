#!/usr/bin/env bash
# The GPU check on a machine with Python, torch and a CUDA driver (`make gpu-check`, or the device tool):
#   bash benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options...]
# If that Python lacks what the suite imports (transformers >= 5.24, omegaconf, tokenizers, MLflow, ...),
# gpu_bundle/site.tar.xz (`make gpu-bundle`, built on a networked machine) is unpacked into a temporary folder
# first and put on PYTHONPATH, no network needed; torch is never installed. PYTHON picks the interpreter
# (default python3).
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
    for name in ("omegaconf", "tokenizers", "safetensors", "yaml", "tqdm", "filelock", "mlflow", "sqlalchemy",
                 "alembic", "math_verify"):
        __import__(name)
except Exception:
    ok = False
sys.exit(0 if ok else 1)
PY
}
if ! has_deps; then
    [ -f "$bundle/site.tar.xz" ] || { echo "error: $py lacks the suite's packages and $bundle/site.tar.xz is missing (make gpu-bundle)" >&2; exit 2; }
    site=$(mktemp -d /tmp/gspo-gpu-site.XXXXXX)
    tar -xJf "$bundle/site.tar.xz" -C "$site"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "unpacked $(wc -l < "$bundle/REQUIREMENTS.txt") packages from $bundle/site.tar.xz into $site"
fi
PYTHONUNBUFFERED=1 exec "$py" -m benchmarks.gpu_check --out "$out" "$@"
