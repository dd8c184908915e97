#!/usr/bin/env bash
# Run a unidist script with horovodrun: launch_scripts/horovodrun.sh N script.py [args...]
# Uses Horovod's gloo controller (no MPI needed) with all ranks on this host; for several hosts use
# -H host1:4,host2:4 (ssh to each). With MPI, `UNIDIST_BACKEND=horovod mpiexec -n N python script.py`
# works too: plain mpiexec looks like MPI, so the variable picks Horovod.
set -euo pipefail
n=${1:?usage: horovodrun.sh N script.py [args...]}
shift
py=$(command -v python3 || command -v python)
exec horovodrun -np "$n" --gloo -H "localhost:$n" "$py" "$@"
