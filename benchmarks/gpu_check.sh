#!/usr/bin/env bash
# The prepared checks of a lent GPU, as two calls of a 15-minute device budget (benchmarks/gpu_check.py says what
# each part runs and how its time is shared):
#   python benchmarks/gpu_check.py --prepare --wheels DIR   # first, here (with git): .gpu-check/ to carry
#   benchmarks/gpu_check.sh [--part 1]                      # call 1 (<= 6 min): the smoke matrix, never-run/changed rows first
#   benchmarks/gpu_check.sh --part 2                        # call 2 (<= 6 min): numerics, measure at size, step time
#   benchmarks/gpu_check.sh --part 1 --device cpu           # a dry run of the planning at tiny sizes
# Results: $OUT if set (the device tool), else benchmarks/results. On the GPU machine (no network, no .git) the
# package runs from this checkout (PYTHONPATH); its Python holds torch, lightning, transformers, torchmetrics, rich,
# safetensors, tokenizers, pyyaml; the wheels carried in .gpu-check/wheels (torchao for float8, jsonargparse for
# LightningCLI's `fit`) are installed into /tmp/l4d-site first, in each call (a fresh machine is bare).
set -uo pipefail
cd "$(dirname "$0")/.."
CPU=0
for a in "$@"; do [ "$a" = "cpu" ] && CPU=1; done
PY=${PYTHON:-$( [ -x .venv/bin/python ] && [ $CPU = 1 ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ $CPU = 0 ] && compgen -G ".gpu-check/wheels/*.whl" >/dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/l4d-site \
      .gpu-check/wheels/*.whl; then
    export PYTHONPATH="$PYTHONPATH:/tmp/l4d-site"
    echo "installed: $(cd .gpu-check/wheels && ls *.whl | tr '\n' ' ')"
  else
    echo "the carried wheels did not install: float8 rows and fit will fail" >&2
  fi
fi
[ -f .gpu-check/code.json ] || [ -d .git ] || echo "no .git and no .gpu-check/code.json: results record no commit (run gpu_check.py --prepare first)" >&2
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
"$PY" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
exec "$PY" benchmarks/gpu_check.py --out "$RESULTS" "$@"
