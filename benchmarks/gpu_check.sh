#!/usr/bin/env bash
# The prepared checks of a lent GPU in one call (benchmarks/gpu_check.py says what they are):
#   benchmarks/gpu_check.sh [--device cpu]        # results: $OUT if set (the device tool), else benchmarks/results
# On the GPU machine (no network) the package runs from this checkout (PYTHONPATH); its Python already holds torch,
# lightning, transformers, torchmetrics, rich, safetensors, tokenizers, pyyaml: measure and the step timing need no
# more (jsonargparse serves only LightningCLI's `fit`).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && [ "${1:-}" = "--device" ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
"$PY" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
exec "$PY" benchmarks/gpu_check.py --out "$RESULTS" "$@"
