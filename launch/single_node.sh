#!/usr/bin/env bash
# One machine: one rp_engine process drives every local GPU. Usage:
#   launch/single_node.sh train.py --deepspeed_config ds_config.json
set -euo pipefail
exec torchrun --standalone --nnodes 1 --nproc_per_node 1 "$@"
