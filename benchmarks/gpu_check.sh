#!/usr/bin/env bash
# One prepared GPU check (a few minutes): install, run the tests marked `gpu`, then rp-train on
# CUDA. For a session that is lent a device machine:
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=540)
# Writes the logs to $OUT (or ./gpu_check_out) for benchmarks/RESULTS.md.
set -uo pipefail
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
export TORCH_EXTENSIONS_DIR="$HOME/.cache/rp_engine/torch_extensions" WANDB_MODE=disabled
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q -e ".[dev]" 2>&1 | tail -3 | tee "$out/install.log"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python -m pytest -q -ra -m gpu tests/test_device_cuda.py tests/test_engine_cuda.py 2>&1 | tee "$out/gpu_tests.log"
rp-train --steps 20 --json 2>"$out/rp_train.err" | tee "$out/rp_train.json"
