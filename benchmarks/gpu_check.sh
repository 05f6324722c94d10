#!/usr/bin/env bash
# One prepared GPU check: ONE device call of about 6 minutes, at most 8 files back.
#
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   GPU_CHECK_DRY=1 OUT=$(mktemp -d) bash benchmarks/gpu_check.sh   # the same plumbing on CPU
#
# In order (most important first, so a run cut short keeps what matters):
#   1. the CUDA tests (-m gpu: test_device_cuda, test_engine_cuda, test_device_grad_norm,
#      test_host_path);
#   2. benchmarks.head_to_head on the Qwen3-1.7B shape (bf16, micro-batch 4 x 1,024, GAS 4):
#      roundpipe (train_batch), roundpipe_loop (DeepSpeed's own loop on rp_engine),
#      roundpipe_sync, deepspeed, torch; 1 warm-up and 3 timed steps, one repeat,
#      each system in its own process (killed after $H2H_TIMEOUT s); the parent appends each
#      system's JSON line to h2h.jsonl as soon as that system ends, and rewrites the table;
#   3. a few rp-train steps (--no-wandb: wandb is not on the device image), only if time is left.
# No Qwen3-8B leg: its fp32 model and 16 B per parameter of host state do not fit that machine's
# 128 GB of host memory.
#
# What lands in $OUT (default ./gpu_check_out), 4 files:
#   gpu_check.log   everything this script printed (test output, progress, errors)
#   h2h.jsonl       one JSON line per finished system run
#   h2h_table.md    the head-to-head table (of what ran so far, should the run be cut short)
#   gpu_check_rest.tar  the rest: gpu.txt, versions.txt, gpu_tests.log, h2h.json (with the
#                   timelines), h2h_children.err (every system's stderr), rp_train.{json,err}
#
# GPU_CHECK_DRY=1 runs the same legs on CPU: no wheels, the "tiny" model on cpu:2 virtual
# devices, the CUDA tests collected and skipped; tests/bench/test_gpu_check.py runs it in CI.
#
# The device machine (Python 3.12, torch with CUDA, transformers 5.17, no network) lacks
# deepspeed, hjson, pydantic and transformers 5.24. Carry them as wheels built for ITS Python and
# platform (shared/reference/gpu_measurements.md; /work/.library/device/README.md). Once, in
# the repo root here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux1_x86_64 -d .whl hjson==3.1.0 transformers==5.24.0 \
#       pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions
#   python3 -m pip wheel --no-deps -w .whl deepspeed==0.19.8
# (about 20 MB; without the platform flags pip fetches this machine's cp311 pydantic-core, which
# aborts the install there). A failed install or a missing module stops the script at once.
set -uo pipefail
cd "$(dirname "$0")/.."
dry="${GPU_CHECK_DRY:-0}"
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"  # everything but the 3 main files; tarred into $OUT after every leg
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/rp_engine/torch_extensions}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}" WANDB_MODE=disabled PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"  # CI passes its venv's interpreter

if [[ "$dry" == 1 ]]; then
    model=tiny devices=cpu:2 h2h_timeout="${H2H_TIMEOUT:-300}" budget_s="${GPU_CHECK_BUDGET_S:-600}"
else
    model=qwen3-1.7b devices=cuda h2h_timeout="${H2H_TIMEOUT:-150}"
    budget_s="${GPU_CHECK_BUDGET_S:-390}"
fi

pack() {
    tar -cf "$out/gpu_check_rest.tar.part" -C "$work" . && mv "$out/gpu_check_rest.tar.part" \
        "$out/gpu_check_rest.tar"
}

install_wheels() {
    # The carried wheels first on the path; any failure ends the run before a GPU minute is spent.
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || { echo "gpu_check: wheel install failed"; return 1; }
        export PYTHONPATH="/tmp/site:$PWD"
    else
        export PYTHONPATH="$PWD"
    fi
    "$py" -c "import deepspeed, hjson, pydantic, transformers" \
        || { echo "gpu_check: a module is missing (carry .whl, see this script's head)"; return 1; }
}

legs() {
    local rc=0
    echo "gpu_check: dry=$dry model=$model devices=$devices out=$out"
    if [[ "$dry" == 1 ]]; then
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
        echo "dry run: no GPU" >"$work/gpu.txt"
    else
        install_wheels || exit 2
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/gpu.txt"
    fi
    "$py" -c "import torch, transformers, deepspeed; print(torch.__version__, \
torch.version.cuda, transformers.__version__, deepspeed.__version__)" | tee "$work/versions.txt"
    pack

    echo "== 1. CUDA tests ($SECONDS s)"
    timeout 240 "$py" -m pytest -q -ra -p no:cacheprovider -m gpu tests/unit/test_device_cuda.py \
        tests/engine/test_engine_cuda.py tests/engine/test_device_grad_norm.py \
        tests/engine/test_host_path.py 2>&1 | tee "$work/gpu_tests.log"
    local tests_rc=$?
    echo "gpu_check: tests rc=$tests_rc"
    pack

    echo "== 2. head-to-head, $model ($SECONDS s)"
    "$py" -m benchmarks.head_to_head --model "$model" --devices "$devices" \
        --systems roundpipe,roundpipe_loop,roundpipe_sync,deepspeed,torch --repeats 1 \
        --warmup 1 --steps 3 \
        --no-calibrate --timeout "$h2h_timeout" --jsonl "$out/h2h.jsonl" \
        --table "$out/h2h_table.md" --json "$work/h2h.json" --child-log "$work/h2h_children.err"
    local h2h_rc=$?
    echo "gpu_check: head_to_head rc=$h2h_rc (1: a system failed or the losses disagree)"
    pack

    if ((SECONDS < budget_s - 60)); then
        echo "== 3. rp-train, a few steps ($SECONDS s)"
        timeout 60 "$py" -m rp_engine.train.cli --devices "$devices" --steps 4 --no-wandb --no-save \
            --no-preflight --eval-split 0 --out "$work/rp_train" --json \
            >"$work/rp_train.json" 2>"$work/rp_train.err"
        local train_rc=$?
        tail -n 3 "$work/rp_train.err"
        echo "gpu_check: rp-train rc=$train_rc"
        ((train_rc)) && rc=$train_rc
    else
        echo "== 3. rp-train skipped: $SECONDS s of a $budget_s s budget gone"
    fi
    rm -rf "$work/rp_train"
    pack
    ((h2h_rc)) && rc=$h2h_rc
    ((tests_rc)) && rc=$tests_rc
    echo "gpu_check: done in $SECONDS s, rc=$rc"
    return $rc
}

legs 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
rm -rf "$work"
exit "$status"
