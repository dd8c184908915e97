#!/usr/bin/env bash
# A real Slurm for tests/slurm and tests/cluster/test_slurm_hosts.py, from Debian's packages (slurm-wlm, munge:
# 22.05 on Debian 12; measured 7 s here). Installs only when missing and this is root on a Debian-like system;
# the tests start their own daemons from a generated slurm.conf in a temporary directory (nothing system-wide is
# configured or started here). Otherwise says why and leaves the verdict to the tests (they skip saying why, or
# fail when REQUIRE_SLURM=1, as tox sets by default).
set -euo pipefail
export PATH="$PATH:/usr/sbin"
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v srun >/dev/null; then
    echo "slurm: $(slurmctld -V)"; exit 0
fi
if [ "$(id -u)" != 0 ]; then echo "slurm: not installed, and not root: not installing it"; exit 0; fi
if ! command -v apt-get >/dev/null; then echo "slurm: not installed, and no apt-get (not Debian): not installing it"; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq slurm-wlm munge >/dev/null
echo "slurm: installed $(slurmctld -V)"
