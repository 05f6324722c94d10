#!/usr/bin/env bash
# One prepared GPU check: ONE device call of at most 9 minutes, at most 8 files back.
#
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   GPU_CHECK_DRY=1 OUT=$(mktemp -d) bash benchmarks/gpu_check.sh   # the same plumbing on CPU
#
# Time: the script keeps to GPU_CHECK_BUDGET_S (default 500 s on a GPU, leaving the 540 s call
# room to pack). The legs run most important first, each only with enough of the budget left
# and each bounded by what is left, so a run cut short keeps what matters; a full run does not
# fit 9 minutes on one GPU (the head-to-head alone takes 5-6), so the last legs are often
# skipped, saying so. GPU_CHECK_LEGS picks legs for a focused call (default, in this order:
# "tests h2h longest_seq rp_train"; "longest_seq_8b" is only run when named):
#   tests        the CUDA tests (-m gpu: test_device_cuda, test_engine_cuda,
#                test_device_grad_norm, test_host_path), at most 240 s;
#   h2h          benchmarks.head_to_head on the Qwen3-1.7B shape (bf16, micro-batch 4 x 1,024,
#                GAS 4): roundpipe (train_batch), roundpipe_lib (the RoundPipe library itself,
#                benchmarks/roundpipe_lib.py), deepspeed, roundpipe_sync, torch, roundpipe_loop
#                (DeepSpeed's own loop on rp_engine), roundpipe_auto (async with
#                staleness_compensation "auto": its cost end to end, issue 43; last, so it
#                runs only with time left); 1 warm-up and 3 timed steps, one repeat,
#                each system in its own process (killed after $H2H_TIMEOUT s); the parent
#                appends each system's JSON line to h2h.jsonl as soon as that system ends, and
#                rewrites the table; with the longest_seq leg selected it leaves that leg
#                $LONGEST_SEQ_RESERVE_S s (systems it cannot start in time are "skipped" rows);
#   longest_seq  benchmarks.longest_seq: the longest sequence rp_engine trains on Qwen3-1.7B
#                within 24 GiB (micro-batch 1; doubling from 64K up to 128K, then bisection to
#                16K; each probe its own process capped at 24 GiB), beside the advisor's
#                prediction and RoundPipe's published 73K; one JSON line per probe and a summary
#                line in longest_seq.jsonl;
#   longest_seq_8b  the same for the Qwen3-8B shape cut to 4 decoder layers (device memory per
#                sequence is one layer's and the head's: the host holds the rest; the full 8B's
#                fp32 model and host state do not fit the machine's 128 GB), beside the
#                published 49K (Llama3.1-8B);
#   rp_train     a few rp-train steps (--no-wandb: wandb is not on the device image).
#
# What lands in $OUT (default ./gpu_check_out), 5 files:
#   gpu_check.log   everything this script printed (test output, progress, errors)
#   h2h.jsonl       one JSON line per system run (or skipped system)
#   h2h_table.md    the head-to-head table (of what ran so far, should the run be cut short),
#                   with notes: where roundpipe_lib's configuration differs, its loss agreement
#   longest_seq.jsonl  the longest-sequence probes and summaries, as they end
#   gpu_check_rest.tar  the rest: gpu.txt, versions.txt, gpu_tests.log, h2h.json (with the
#                   timelines), h2h_children.err (every system's stderr), longest_seq*.json,
#                   longest_seq_children.err, rp_train.{json,err}
#
# GPU_CHECK_DRY=1 runs every leg on CPU: no wheels, the "tiny" model on cpu:2 virtual devices,
# the CUDA tests collected and skipped, roundpipe_lib a "skipped" row (the library needs CUDA),
# the longest-sequence search on a tiny budget and range (two probes; one for longest_seq_8b);
# tests/bench/test_gpu_check.py runs it in CI.
#
# The device machine (Python 3.12, torch with CUDA, transformers 5.17, no network) lacks
# deepspeed, hjson, pydantic, transformers 5.24, roundpipe and beartype (roundpipe's one
# dependency not on the image; ninja, py-cpuinfo, tqdm and typing-extensions are there). Carry
# them as wheels built for ITS Python and platform (shared/reference/gpu_measurements.md;
# /work/.library/device/README.md). Once, in the repo root here (.whl/ is git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux1_x86_64 -d .whl hjson==3.1.0 transformers==5.24.0 \
#       pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions \
#       roundpipe==0.1.1 beartype==0.23.1
#   python3 -m pip wheel --no-deps -w .whl deepspeed==0.19.8
# (about 21 MB; without the platform flags pip fetches this machine's cp311 pydantic-core, which
# aborts the install there). A failed install or a missing module stops the script at once.
set -uo pipefail
cd "$(dirname "$0")/.."
dry="${GPU_CHECK_DRY:-0}"
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"  # everything but the 4 main files; tarred into $OUT after every leg
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/rp_engine/torch_extensions}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}" WANDB_MODE=disabled PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"  # CI passes its venv's interpreter

legs_default="tests h2h longest_seq rp_train"
if [[ "$dry" == 1 ]]; then
    model=tiny devices=cpu:2 h2h_timeout="${H2H_TIMEOUT:-300}" budget_s="${GPU_CHECK_BUDGET_S:-600}"
    min_system_s=30  # a tiny system's process takes seconds
    reserve_s="${LONGEST_SEQ_RESERVE_S:-0}" legs_default="$legs_default longest_seq_8b"
    # the tiny model in 20 MiB: the planner takes 2K tokens, not 4K (two probes; one for 8b)
    seq_args=(--model tiny --budget-gib 0.02 --start 2048 --min 1024 --max 4096 --step 2048
        --min-probe-s 5)
    seq8_args=(--model tiny --layers 2 --budget-gib 0.02 --start 2048 --min 2048 --max 2048
        --step 2048 --min-probe-s 5)
else
    model=qwen3-1.7b devices=cuda h2h_timeout="${H2H_TIMEOUT:-180}"
    budget_s="${GPU_CHECK_BUDGET_S:-500}" reserve_s="${LONGEST_SEQ_RESERVE_S:-150}"
    min_system_s=90  # a 1.7B system's process takes 1-2 minutes: none starts with less
    # a 1.7B probe: ~20 s of model and engine set-up, then 2 steps (about 10 s each at 64K,
    # 40 s at 128K: attention grows with the square); past 128K a probe costs minutes
    seq_args=(--model qwen3-1.7b --budget-gib 24 --start 65536 --min 8192 --max 131072
        --step 16384 --probe-timeout 240 --min-probe-s 60)
    seq8_args=(--model qwen3-8b --layers 4 --budget-gib 24 --start 32768 --min 8192
        --max 131072 --step 16384 --probe-timeout 240 --min-probe-s 60)
fi
legs="${GPU_CHECK_LEGS:-$legs_default}"

pack() {
    tar -cf "$out/gpu_check_rest.tar.part" -C "$work" . && mv "$out/gpu_check_rest.tar.part" \
        "$out/gpu_check_rest.tar"
}

left() { echo $((budget_s - SECONDS)); }  # seconds of the budget still to spend
wants() { [[ " $legs " == *" $1 "* ]]; }  # is leg $1 selected

install_wheels() {
    # The carried wheels first on the path; any failure ends the run before a GPU minute is spent.
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || { echo "gpu_check: wheel install failed"; return 1; }
        export PYTHONPATH="/tmp/site:$PWD"
    else
        export PYTHONPATH="$PWD"
    fi
    # roundpipe is looked up, not imported: its import starts threads on every GPU
    "$py" -c "import importlib.util as u, deepspeed, hjson, pydantic, transformers
assert u.find_spec('roundpipe') and u.find_spec('beartype'), 'roundpipe or beartype'" \
        || { echo "gpu_check: a module is missing (carry .whl, see this script's head)"; return 1; }
}

longest_seq() {  # $1: the output's stem, then the leg's arguments
    local stem=$1
    shift
    local t=$(($(left) - 15)) need=60
    [[ "$dry" == 1 ]] && need=10  # a tiny probe takes seconds, a 1.7B one a minute
    if ((t < need)); then
        echo "== $stem skipped: $SECONDS s of a $budget_s s budget gone"
        return 0
    fi
    echo "== $stem ($SECONDS s, ${t} s for it)"
    "$py" -m benchmarks.longest_seq "$@" --devices "$devices" --time-budget "$t" \
        --jsonl "$out/longest_seq.jsonl" --json "$work/$stem.json" \
        --child-log "$work/longest_seq_children.err"
    local seq_rc=$?
    echo "gpu_check: $stem rc=$seq_rc (1: no length it probed trained)"
    pack
    return $seq_rc
}

legs() {
    local rc=0 tests_rc=0 h2h_rc=0 seq_rc=0 seq8_rc=0
    echo "gpu_check: dry=$dry model=$model devices=$devices legs=[$legs] budget=${budget_s}s out=$out"
    if [[ "$dry" == 1 ]]; then
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
        echo "dry run: no GPU" >"$work/gpu.txt"
    else
        install_wheels || exit 2
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/gpu.txt"
    fi
    "$py" -c "import torch, transformers, deepspeed, importlib.metadata as m, importlib.util as u
print(torch.__version__, torch.version.cuda, transformers.__version__, deepspeed.__version__,
      'roundpipe', m.version('roundpipe') if u.find_spec('roundpipe') else None)" \
        | tee "$work/versions.txt"
    pack

    if wants tests; then
        local t=$(($(left) < 240 ? $(left) : 240))
        if ((t >= 30)); then
            echo "== CUDA tests ($SECONDS s)"
            timeout "$t" "$py" -m pytest -q -ra -p no:cacheprovider -m gpu \
                tests/unit/test_device_cuda.py tests/engine/test_engine_cuda.py \
                tests/engine/test_device_grad_norm.py tests/engine/test_host_path.py 2>&1 \
                | tee "$work/gpu_tests.log"
            tests_rc=${PIPESTATUS[0]}
            echo "gpu_check: tests rc=$tests_rc"
        else
            echo "== CUDA tests skipped: $SECONDS s of a $budget_s s budget gone"
        fi
        pack
    fi

    if wants h2h; then
        local keep=0
        wants longest_seq && keep=$reserve_s
        local t=$(($(left) - keep))
        echo "== head-to-head, $model ($SECONDS s, ${t} s for it)"
        "$py" -m benchmarks.head_to_head --model "$model" --devices "$devices" \
            --systems roundpipe,roundpipe_lib,deepspeed,roundpipe_sync,torch,roundpipe_loop,roundpipe_auto \
            --repeats 1 --warmup 1 --steps 3 --no-calibrate --timeout "$h2h_timeout" \
            --time-budget "$((t > 0 ? t : 0))" --min-child-s "$min_system_s" \
            --jsonl "$out/h2h.jsonl" \
            --table "$out/h2h_table.md" --json "$work/h2h.json" \
            --child-log "$work/h2h_children.err"
        h2h_rc=$?
        echo "gpu_check: head_to_head rc=$h2h_rc (1: a system failed or the losses disagree)"
        pack
    fi

    if wants longest_seq; then
        longest_seq longest_seq "${seq_args[@]}"
        seq_rc=$?
    fi
    if wants longest_seq_8b; then
        longest_seq longest_seq_8b "${seq8_args[@]}"
        seq8_rc=$?
    fi

    if wants rp_train; then
        if (($(left) >= 60)); then
            echo "== rp-train, a few steps ($SECONDS s)"
            timeout 60 "$py" -m rp_engine.train.cli --devices "$devices" --steps 4 --no-wandb \
                --no-save --no-preflight --eval-split 0 --out "$work/rp_train" --json \
                >"$work/rp_train.json" 2>"$work/rp_train.err"
            local train_rc=$?
            tail -n 3 "$work/rp_train.err"
            echo "gpu_check: rp-train rc=$train_rc"
            ((train_rc)) && rc=$train_rc
        else
            echo "== rp-train skipped: $SECONDS s of a $budget_s s budget gone"
        fi
        rm -rf "$work/rp_train"
        pack
    fi
    ((seq8_rc)) && rc=$seq8_rc
    ((seq_rc)) && rc=$seq_rc
    ((h2h_rc)) && rc=$h2h_rc
    ((tests_rc)) && rc=$tests_rc
    echo "gpu_check: done in $SECONDS s, rc=$rc"
    return $rc
}

legs 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
rm -rf "$work"
exit "$status"
