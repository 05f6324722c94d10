#!/usr/bin/env bash
# One prepared GPU check (a few minutes) for a session that is lent the H200 device machine.
# That machine has torch (CUDA), transformers, peft, pytest and ninja, but no deepspeed, hjson or
# wandb, and no network. Prepare the missing pure-Python wheels here first (repo root):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl hjson==3.1.0
#   python3 -m pip wheel --no-deps -w .whl deepspeed==0.19.8
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Logs land in $OUT (or ./gpu_check_out) for benchmarks/RESULTS.md. Not yet run on a GPU.
# Besides the CUDA tests it runs the head-to-head (python -m benchmarks.head_to_head) on the
# Qwen3-1.7B shape and on the Qwen3-8B shape (does not train in 24 GB without offload): DeepSpeed
# ZeRO-Infinity, rp_engine async / sync / Mobius, plain PyTorch; each in its own process, a window
# of steps timed between two synchronisations; one JSON file per model. The device machine also lacks
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
python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/unit/test_device_cuda.py \
    tests/engine/test_engine_cuda.py tests/engine/test_device_grad_norm.py 2>&1 | tee "$out/gpu_tests.log"
python3 -m rp_engine.train.cli --steps 20 --json 2>"$out/rp_train.err" | tee "$out/rp_train.json"
python3 -m benchmarks.head_to_head --model qwen3-1.7b --repeats 1 --warmup 2 --steps 5 \
    --json "$out/h2h_qwen3_1.7b.json" 2>"$out/h2h_qwen3_1.7b.err" | tee "$out/h2h_qwen3_1.7b.md"
python3 -m benchmarks.head_to_head --model qwen3-8b --repeats 1 --warmup 1 --steps 3 \
    --systems deepspeed,roundpipe,roundpipe_sync,mobius --no-calibrate \
    --json "$out/h2h_qwen3_8b.json" 2>"$out/h2h_qwen3_8b.err" | tee "$out/h2h_qwen3_8b.md"
