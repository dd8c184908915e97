#!/usr/bin/env bash
# Run a unidist script with the deepspeed launcher: launch_scripts/deepspeed.sh N script.py [args...]
# --num_gpus N starts N processes (DeepSpeed's CPU accelerator honours it too on machines without a GPU);
# a free --master_port avoids a clash on the default 29500; --no_local_rank keeps the script's argv as given.
# Several nodes: add --hostfile launch_scripts/hostfile (ssh to each host) and drop --num_gpus.
set -euo pipefail
n=${1:?usage: deepspeed.sh N script.py [args...]}
shift
port=${MASTER_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
exec deepspeed --num_gpus "$n" --master_port "$port" --no_local_rank "$@"
