#!/usr/bin/env bash
# The first machine with a GPU: every CUDA test (`pytest -m gpu`), then 8 minutes of
# names-only SEED + V-trace Pong on cuda (benchmarks/gpu_pong.sh). Writes the test log,
# the failures and the run folder under OUT (default runs/gpu_check) and prints a summary.
#
#   bash benchmarks/gpu_check.sh [PONG_SECONDS]
set -uo pipefail
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
  'bf16', torch.cuda.is_bf16_supported(including_emulation=False))" >> "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
python -m pytest -m gpu -q -rf tests/test_gpu.py > "$out/pytest_gpu.log" 2>&1
echo "pytest -m gpu exited with $?; failures:"
grep -E "^(FAILED|ERROR)" "$out/pytest_gpu.log" || echo "  none"
tail -1 "$out/pytest_gpu.log"
OUT="$out" bash "$(dirname "$0")/gpu_pong.sh" "${1:-480}"
