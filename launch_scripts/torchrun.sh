#!/usr/bin/env bash
# Run a unidist script with torchrun: launch_scripts/torchrun.sh N script.py [args...]
# Single node. For several nodes run on each: torchrun --nnodes M --node_rank I --nproc_per_node N \
#   --rdzv_backend c10d --rdzv_endpoint HOST0:29400 script.py
set -euo pipefail
n=${1:?usage: torchrun.sh N script.py [args...]}
shift
exec torchrun --standalone --nproc_per_node "$n" "$@"
