#!/usr/bin/env bash
# Run a unidist script on N MPI ranks on this machine: launch_scripts/mpirun.sh N script.py [args...]
# Prefers the mpiexec next to the active python (the mpich wheel installs one there), so it matches mpi4py.
set -euo pipefail
n=${1:?usage: mpirun.sh N script.py [args...]}
shift
py=$(command -v python3 || command -v python)
mpiexec=$(dirname "$py")/mpiexec
[ -x "$mpiexec" ] || mpiexec=$(command -v mpiexec || command -v mpirun)
exec "$mpiexec" -n "$n" "$py" "$@"
