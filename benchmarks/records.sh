#!/usr/bin/env bash
# Regenerates benchmarks/records/*.md: the measurements the docs quote besides RESULTS.md, each one run of one
# command on this machine, written by `python -m unidist.bench.record` with the command, the machine and the load.
# The pages include these files as they are, so a page's figure is what the command last printed.
#
#   bash benchmarks/records.sh                 # all (about 20 minutes; run it on a quiet machine)
#   bash benchmarks/records.sh check faults    # some: check, timeline, checkpoint, faults, zoo, step, verify,
#                                              # startup, ds_scripts, build, ckload
#
# Python comes from BENCH_BIN (a directory with python, mpiexec and every engine; default: .tox/py/bin, whose
# environment has mpi4py and torch; the fault table and the model zoo's need every engine (and transformers), so
# point BENCH_BIN at one that has them).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${BENCH_BIN:-.tox/py/bin}"
export PATH="$bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
out=benchmarks/records
record() { "$bin/python" -m unidist.bench.record "$@"; }
want() { [ $# -eq 0 ] || [[ " $* " == *" $name "* ]]; }
for name in check timeline checkpoint faults zoo step verify startup ds_scripts build ckload; do
    want "${@}" || continue
    case $name in
    check) record $out/check.md -- mpiexec -n 2 python -m unidist.bench.check --rounds 21 ;;
    timeline) record $out/timeline_cost.md -- python -m unidist.bench.timeline_cost ;;
    checkpoint)
        scratch=$(mktemp -d)
        record $out/checkpoint_background.md -- mpiexec -n 2 python -m unidist.bench.checkpoint --dir "$scratch/ck" \
            --background
        rm -rf "$scratch" ;;
    faults)
        rows=$(mktemp); start=$(date +%s)
        UNIDIST_FAULT_TABLE="$rows" "$bin/python" -m pytest -q -p no:cacheprovider tests/multiproc/test_faults.py
        record $out/faults.md --faults "$rows" --seconds $(( $(date +%s) - start )) \
            --command "UNIDIST_FAULT_TABLE=FILE python -m pytest tests/multiproc/test_faults.py"
        rm -f "$rows" ;;
    zoo)
        rows=$(mktemp); start=$(date +%s)
        ZOO_MATRIX=all ZOO_TABLE="$rows" "$bin/python" -m pytest -q -p no:cacheprovider tests/multiproc/test_model_zoo.py
        record $out/model_zoo.md --table "$rows" --seconds $(( $(date +%s) - start )) \
            --command "ZOO_MATRIX=all ZOO_TABLE=FILE python -m pytest tests/multiproc/test_model_zoo.py"
        rm -f "$rows" ;;
    step)  # the wrapper's cost: one process, then 2 ranks beside DDP and FSDP2, then beside raw DeepSpeed
        record $out/step_local.md -- python -m unidist.bench.step --rounds 7
        record $out/step_torchrun.md -- torchrun --standalone --nproc_per_node 2 -m unidist.bench.step --rounds 7
        record $out/step_deepspeed.md -- deepspeed --num_gpus 2 unidist/bench/step.py --rounds 7 \
            --columns plain,ds-z0,ds-z1,ds-z2,ds-z3,unidist-z0,unidist-z1,unidist-z2,unidist-z3 ;;
    verify)  # unidist verify on the main example under every launcher here (and its picture), four mistakes planted
             # on the zoo's GPT-2 caught and located, then what the fingerprint it compares costs a training step
        record $out/verify_digits.md -- unidist verify --plot docs/verify.png examples/train_digits.py --epochs 3
        record $out/verify_planted.md --exit 1 -- unidist verify --locate --launch "mpiexec -n 2" \
            --launch "PLANT=batch mpiexec -n 2" --launch "PLANT=lr mpiexec -n 2" --launch "PLANT=wd mpiexec -n 2" \
            --launch "PLANT=shuffle mpiexec -n 2" tests/verify_scripts/zoo_model.py --model gpt2 --zero 3
        record $out/fingerprint_cost.md -- mpiexec -n 2 python -m unidist.bench.fingerprint --rounds 7 ;;
    startup)  # unidist.init() beside each engine's own start, every backend's main launch
        record $out/startup.md -- python -m unidist.bench.startup --rounds 7 ;;
    ds_scripts)  # DeepSpeed pipeline and MoE scripts' step: real DeepSpeed beside the compat layer on mpi and torch
        record $out/ds_pipeline.md -- python benchmarks/ds_scripts.py --kind pipeline --rounds 5
        record $out/ds_moe.md -- python benchmarks/ds_scripts.py --kind moe --rounds 5 ;;
    build)  # a model built partitioned (zero.Init: unidist's, DeepSpeed's) beside built whole: peak memory, time
        record $out/partitioned_build.md -- python benchmarks/partitioned_build.py --ranks 2 --layers 24 --width 1024
        record $out/partitioned_build_4.md -- python benchmarks/partitioned_build.py --ranks 4 --layers 24 \
            --width 1024 ;;
    ckload)  # a GPT-2 124M checkpoint with its AdamW state loaded: unidist's format and DCP beside DCP's own load
        record $out/checkpoint_load.md -- python benchmarks/checkpoint_load.py ;;
    esac
done
