#!/usr/bin/env bash
# The one command that regenerates benchmarks/RESULTS.md, benchmarks/collectives.png and benchmarks/results/:
# `python -m unidist.bench all --compare` (collectives, gradsync, train) on 2 ranks under mpiexec, torchrun,
# the deepspeed launcher, horovodrun --gloo and mpiexec with UNIDIST_BACKEND=horovod, one after the other,
# measuring this working tree (PYTHONPATH), then the tables and the plot from the JSON files.
#
# Each engine comes from its tox environment (`python3 -m tox` creates them); point elsewhere with BENCH_BIN
# (one directory for every engine) or BENCH_MPI_BIN, BENCH_TORCH_BIN, BENCH_DEEPSPEED_BIN, BENCH_HOROVOD_BIN.
# Arguments go to `python -m unidist.bench report`: --runs mpi,torch (a subset), --render-only (no runs),
# -n 3, and after -- options for every run (-- --max-size 32M). Long: run it on a quiet machine.
# Last, it prints which figures moved beyond the noise (10%, --noise) since the committed results/*.json (read
# before the runs overwrite them), and on what machines (RESULTS.md's header says how rows match);
# --render-only --out-dir OTHER --against benchmarks compares another result set with these, running nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
bindir() { local name="BENCH_$1_BIN"; echo "${!name:-${BENCH_BIN:-.tox/$2/bin}}"; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$(bindir MPI py)/python" -m unidist.bench report --bin mpi="$(bindir MPI py)" --bin torch="$(bindir TORCH torch)" \
    --bin deepspeed="$(bindir DEEPSPEED deepspeed)" --bin horovod="$(bindir HOROVOD horovod)" "$@"
