#!/usr/bin/env bash
# One prepared GPU check (a few minutes) for a session that is lent the H200 device machine.
# That machine has torch (CUDA), transformers, peft, pytest and ninja, but no deepspeed, hjson or
# wandb, and no network. Prepare the missing pure-Python wheels here first (repo root):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl hjson==3.1.0
#   python3 -m pip wheel --no-deps -w .whl deepspeed==0.19.8
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Logs land in $OUT (or ./gpu_check_out) for benchmarks/RESULTS.md. Not yet run on a GPU.
# Besides the CUDA tests it runs the head-to-head on the Qwen3-1.7B shape (one JSON line per
# system: plain PyTorch, DeepSpeed ZeRO-Infinity, rp_engine async and sync; each in its own
# process, a window of steps timed between two synchronisations). The device machine also lacks
# pydantic: add pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
# typing-extensions to the download above (see shared/reference/gpu_measurements.md).
set -uo pipefail
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
export TORCH_EXTENSIONS_DIR="$HOME/.cache/rp_engine/torch_extensions" WANDB_MODE=disabled
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" \
    | tee "$out/versions.txt"
python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_device_cuda.py \
    tests/test_engine_cuda.py 2>&1 | tee "$out/gpu_tests.log"
python3 -m rp_engine.cli --steps 20 --json 2>"$out/rp_train.err" | tee "$out/rp_train.json"
python3 benchmarks/gpu_head_to_head.py --shape qwen3-1.7b --warmup 2 --steps 5 \
    2>"$out/head_to_head.err" | tee "$out/head_to_head.jsonl"
