#!/usr/bin/env bash
# N machines with torchrun's c10d rendezvous: run the same command on every machine.
#   NNODES=4 HEAD=node0 [PORT=29500] [JOB_ID=rp] launch/torchrun_nodes.sh train.py --deepspeed_config ds.json
# One process per machine (--nproc_per_node 1): it drives all of that machine's GPUs.
set -euo pipefail
: "${NNODES:?set NNODES to the number of machines}"
: "${HEAD:?set HEAD to a host name or address every machine can reach (the rendezvous)}"
exec torchrun --nnodes "$NNODES" --nproc_per_node 1 \
    --rdzv_id "${JOB_ID:-rp}" --rdzv_backend c10d --rdzv_endpoint "$HEAD:${PORT:-29500}" "$@"
