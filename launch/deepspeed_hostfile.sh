#!/usr/bin/env bash
# N machines with the deepspeed launcher (pdsh over ssh, as DeepSpeed): run on the head node.
#   launch/deepspeed_hostfile.sh HOSTFILE train.py --deepspeed_config ds.json
# One process per host (--num_gpus 1); all_gpus.sh gives it back every GPU of its host. The
# script receives --local_rank=0, as under DeepSpeed (rp_engine.add_config_arguments users
# parse it with argparse).
set -euo pipefail
hostfile=${1:?usage: deepspeed_hostfile.sh HOSTFILE train.py [args]}
shift
here=$(cd "$(dirname "$0")" && pwd)
exec deepspeed --hostfile "$hostfile" --num_gpus 1 --no_python "$here/all_gpus.sh" "$@"
