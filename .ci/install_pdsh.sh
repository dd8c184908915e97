#!/usr/bin/env bash
# Debian's pdsh, for the deepspeed rows of tests/cluster (test_launch_cli.py, test_suites.py): DeepSpeed's own multinode runner (`deepspeed
# --hostfile`, its default launcher) on the real pdsh, and `unidist launch --backend deepspeed` beside it (which
# must not use it). Installs only when missing and this is root on a Debian-like system, as .ci/install_slurm.sh
# does for Slurm; nothing is configured (DeepSpeed's runner sets PDSH_RCMD_TYPE=ssh itself). Otherwise says why
# and leaves the verdict to the tests (they skip saying why, or fail when REQUIRE_PDSH=1). The test module runs
# this itself when REQUIRE_PDSH=1 and pdsh is missing.
set -euo pipefail
if command -v pdsh >/dev/null; then echo "pdsh: $(pdsh -V 2>&1 | head -1)"; exit 0; fi
if [ "$(id -u)" != 0 ]; then echo "pdsh: not installed, and not root: not installing it"; exit 0; fi
if ! command -v apt-get >/dev/null; then echo "pdsh: not installed, and no apt-get (not Debian): not installing it"; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq pdsh >/dev/null
echo "pdsh: installed $(pdsh -V 2>&1 | head -1)"
