#!/usr/bin/env bash
# Under the deepspeed launcher (--no_python): undo its one-GPU CUDA_VISIBLE_DEVICES so the single
# rp_engine process of this node sees every GPU (or those in RP_VISIBLE_DEVICES), then run
# python. The launcher passes `--local_rank=N` before the script: it goes after it, as usual.
set -euo pipefail
if [[ -n "${RP_VISIBLE_DEVICES:-}" ]]; then
    export CUDA_VISIBLE_DEVICES="$RP_VISIBLE_DEVICES"
else
    unset CUDA_VISIBLE_DEVICES
fi
local_rank=()
if [[ "${1:-}" == --local_rank=* ]]; then
    local_rank=("$1")
    shift
fi
script=${1:?usage: all_gpus.sh [--local_rank=N] train.py [args]}
shift
exec python -u "$script" "${local_rank[@]}" "$@"
