#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (PyTorch + MPI + Gloo, CPU only) into an
# existing Python environment, then verify it with `horovodrun --check-build`.
#
# Usage:
#   PYTHON=/path/to/venv/bin/python bash launch_scripts/install_horovod.sh
#   (without PYTHON, the `python` found on PATH is used)
#
# Prerequisites, installed in that same environment beforehand:
#   pip install torch==2.13.0 mpi4py mpich
# plus a C++ compiler (g++) and CMake (`apt-get install g++ cmake`).
#
# Why this is not just `pip install horovod`:
#   * Horovod 0.28.1 (its last release) asks CMake for C++14, but torch >= 2.1
#     headers need C++17. A tiny compiler wrapper (made in a temp dir, removed
#     on exit) rewrites -std=c++11/14 to -std=c++17. Horovod's sources are not
#     touched.
#   * CMake >= 4 rejects the CMake minimum version declared by the bundled gloo;
#     a CMake 3.x is preferred, else CMAKE_POLICY_VERSION_MINIMUM=3.5 is set.
#   * --no-build-isolation so the build sees the environment's torch; the venv's
#     bin dir goes first on PATH so CMake's FindMPI finds the mpich wheel's
#     mpicxx/mpicc.
#   * pip's wheel cache is left on, so a later install on this machine (e.g. in
#     a fresh venv with the same torch) reuses the built wheel in seconds.
#
# Idempotent: if horovod 0.28.1 with PyTorch, MPI and Gloo support already
# imports cleanly, the build is skipped; the check always runs.
set -euo pipefail

HOROVOD_VERSION=0.28.1
PROG=install_horovod.sh

die() {
    echo "$PROG: ERROR: $*" >&2
    exit 1
}
log() {
    echo "$PROG: $*"
}

# --- the Python environment ------------------------------------------------
PYTHON="${PYTHON:-python}"
PYTHON_PATH="$(command -v -- "$PYTHON" 2>/dev/null)" ||
    die "Python interpreter '$PYTHON' not found (set PYTHON=/path/to/venv/bin/python)"
PYTHON="$PYTHON_PATH"
log "using Python: $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])'))"

TORCH_VERSION="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null)" ||
    die "torch is not importable by $PYTHON. Install it first, e.g.: $PYTHON -m pip install torch==2.13.0 mpi4py mpich"
log "torch $TORCH_VERSION found"

# Directory where the environment's console scripts live (venv/bin): the mpich
# wheel puts mpicc/mpicxx/mpiexec there, pip puts horovodrun there.
SCRIPTS_DIR="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
PYTHON_DIR="$(dirname -- "$PYTHON")"
export PATH="$SCRIPTS_DIR:$PYTHON_DIR:$PATH"

# --- is a good Horovod already there? ---------------------------------------
# Prints "ok" when horovod $HOROVOD_VERSION imports with torch support, was built
# with MPI and Gloo, and was built against the torch that is installed now;
# otherwise prints why not. Never fails.
horovod_status() {
    "$PYTHON" - "$HOROVOD_VERSION" <<'PY' 2>/dev/null || echo "horovod import crashed"
import json, os, sys, warnings
want = sys.argv[1]
try:
    import horovod
except Exception:
    print("horovod not installed"); sys.exit(0)
if horovod.__version__ != want:
    print(f"horovod {horovod.__version__} installed, want {want}"); sys.exit(0)
try:
    import torch
    with open(os.path.join(os.path.dirname(horovod.__file__), "metadata.json")) as f:
        built_for = json.load(f).get("pytorch")
    if built_for != torch.__version__:
        print(f"horovod was built for torch {built_for}, torch {torch.__version__} is installed"); sys.exit(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import horovod.torch as hvd
except Exception as e:
    print(f"import horovod.torch failed: {type(e).__name__}: {e}"); sys.exit(0)
missing = [n for n, ok in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if not ok]
print("ok" if not missing else "horovod built without " + " and ".join(missing))
PY
}

STATUS="$(horovod_status)"
if [ "$STATUS" = "ok" ]; then
    log "horovod $HOROVOD_VERSION with PyTorch/MPI/Gloo already installed: skipping build"
else
    log "need to install horovod $HOROVOD_VERSION ($STATUS)"

    # --- build prerequisites ---------------------------------------------------
    MPICXX="$(command -v mpicxx 2>/dev/null || command -v mpic++ 2>/dev/null || true)"
    [ -n "$MPICXX" ] ||
        die "no MPI C++ compiler wrapper (mpicxx) on PATH or in $SCRIPTS_DIR. Install MPI first, e.g.: $PYTHON -m pip install mpi4py mpich"
    command -v mpiexec >/dev/null 2>&1 ||
        die "mpiexec not found on PATH or in $SCRIPTS_DIR. Install MPI first, e.g.: $PYTHON -m pip install mpi4py mpich"
    log "MPI: $MPICXX ($("$MPICXX" -show 2>/dev/null | head -c 200 || true))"

    # The C++ compiler that the wrapper will call: $CXX if the user set one, else c++.
    REAL_CXX="${CXX:-}"
    if [ -z "$REAL_CXX" ]; then
        REAL_CXX="$(command -v c++ 2>/dev/null || command -v g++ 2>/dev/null || true)"
    fi
    [ -n "$REAL_CXX" ] && command -v -- "$REAL_CXX" >/dev/null 2>&1 ||
        die "no C++ compiler found: install one, e.g. 'apt-get install g++'"
    REAL_CXX="$(command -v -- "$REAL_CXX")"

    # CMake: a 3.x is preferred (Horovod's bundled gloo declares an old minimum
    # version that CMake >= 4 rejects); a CMake >= 4 is used with
    # CMAKE_POLICY_VERSION_MINIMUM=3.5.
    cmake_major() { "$1" --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9]*\)\..*/\1/p' | head -n1; }
    cmake_ver() { "$1" --version 2>/dev/null | sed -n 's/^cmake version \([0-9.]*\).*/\1/p' | head -n1; }
    CMAKE_BIN=""
    FALLBACK_CMAKE=""
    for c in /usr/bin/cmake /usr/local/bin/cmake "$(command -v cmake 2>/dev/null || true)"; do
        [ -n "$c" ] && [ -x "$c" ] || continue
        major="$(cmake_major "$c")"
        [ -n "$major" ] || continue
        if [ "$major" -lt 4 ]; then
            CMAKE_BIN="$c"
            break
        fi
        [ -n "$FALLBACK_CMAKE" ] || FALLBACK_CMAKE="$c"
    done
    if [ -z "$CMAKE_BIN" ] && [ -n "$FALLBACK_CMAKE" ]; then
        CMAKE_BIN="$FALLBACK_CMAKE"
        export CMAKE_POLICY_VERSION_MINIMUM=3.5
    fi
    [ -n "$CMAKE_BIN" ] ||
        die "no cmake found. Install it: 'apt-get install cmake' (or '$PYTHON -m pip install cmake')"
    # Horovod's setup.py would otherwise pip-install a CMake 3.13 if `cmake` is older.
    printf '%s\n%s\n' 3.13 "$(cmake_ver "$CMAKE_BIN")" | sort -V -C ||
        die "$CMAKE_BIN is version $(cmake_ver "$CMAKE_BIN"); Horovod needs CMake >= 3.13 ('apt-get install cmake' or '$PYTHON -m pip install cmake')"
    export HOROVOD_CMAKE="$CMAKE_BIN" # honoured by horovod's setup.py
    log "cmake: $CMAKE_BIN ($(cmake_ver "$CMAKE_BIN"))${CMAKE_POLICY_VERSION_MINIMUM:+, CMAKE_POLICY_VERSION_MINIMUM=$CMAKE_POLICY_VERSION_MINIMUM}"

    # setup.py imports setuptools and packaging before pip installs anything;
    # with --no-build-isolation they must already be in the environment.
    if ! "$PYTHON" -c 'import setuptools, packaging' >/dev/null 2>&1; then
        log "installing build requirements setuptools, packaging"
        "$PYTHON" -m pip install setuptools packaging
    fi

    # Library dirs inside this environment that the extension links against
    # (torch/lib, and the mpich wheel's <venv>/lib), relative to site-packages.
    # CMake bakes them into the extension's RUNPATH as absolute paths of *this*
    # venv; a wheel reused from pip's cache by another venv would then load
    # libmpi from the venv it was built in (and break once that one is deleted).
    # The wrapper below puts $ORIGIN-relative entries first, so each venv uses
    # its own libraries; the absolute entries stay only as a fallback.
    mapfile -t RPATH_REL < <("$PYTHON" - "$("$MPICXX" -show 2>/dev/null || true)" <<'PY'
import os, shlex, sys, sysconfig
import torch
plat = os.path.realpath(sysconfig.get_path("platlib"))
prefix = os.path.realpath(sys.prefix)
dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
dirs += [t[2:] for t in shlex.split(sys.argv[1]) if t.startswith("-L") and len(t) > 2]
seen = []
for d in map(os.path.realpath, dirs):
    if os.path.isdir(d) and os.path.commonpath([d, prefix]) == prefix and d not in seen:
        seen.append(d)
        print(os.path.relpath(d, plat))
PY
    )

    # --- C++17 compiler wrapper, in a temp dir removed on exit ---------------
    WRAP_DIR="$(mktemp -d "${TMPDIR:-/tmp}/horovod-cxx17.XXXXXX")"
    trap 'rm -rf -- "$WRAP_DIR"' EXIT
    {
        echo '#!/usr/bin/env bash'
        echo '# Generated by install_horovod.sh. Horovod 0.28.1 asks for C++14 but'
        echo '# torch >= 2.1 headers need C++17; also makes the RUNPATH of Horovod'"'"'s'
        echo '# extension relative to its install location (see install_horovod.sh).'
        printf 'real_cxx=%q\n' "$REAL_CXX"
        printf 'rpath_rel=('
        [ "${#RPATH_REL[@]}" -eq 0 ] || printf '%q ' "${RPATH_REL[@]}"
        printf ')\n'
        cat <<'WRAP'
args=()
out=""
shared=0
prev=""
for a in "$@"; do
    case "$a" in
        -std=c++11 | -std=c++14 | -std=c++1y) args+=(-std=c++17) ;;
        -std=gnu++11 | -std=gnu++14 | -std=gnu++1y) args+=(-std=gnu++17) ;;
        *) args+=("$a") ;;
    esac
    [ "$a" = -shared ] && shared=1
    [ "$prev" = -o ] && out="$a"
    prev="$a"
done
pre=()
if [ "$shared" = 1 ] && [[ "$out" == */horovod/*.so ]]; then
    # .../horovod/torch/x.so -> $ORIGIN/../.. is site-packages once installed
    rest="${out##*/horovod/}"
    slashes="${rest//[!\/]/}"
    up=".."
    for ((i = 0; i < ${#slashes}; i++)); do up="$up/.."; done
    for r in "${rpath_rel[@]}"; do pre+=("-Wl,-rpath,\$ORIGIN/$up/$r"); done
fi
exec "$real_cxx" "${pre[@]}" "${args[@]}"
WRAP
    } >"$WRAP_DIR/c++17"
    chmod +x "$WRAP_DIR/c++17"
    export CXX="$WRAP_DIR/c++17"
    log "C++ compiler: $CXX -> $REAL_CXX (C++17 forced)"

    # --- build ----------------------------------------------------------------
    # setup.py runs `make -j8` unless MAKEFLAGS is set; match the core count.
    export MAKEFLAGS="${MAKEFLAGS:--j$(nproc 2>/dev/null || echo 2)}"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    unset HOROVOD_WITHOUT_PYTORCH HOROVOD_WITHOUT_GLOO HOROVOD_WITHOUT_MPI
    # CPU only: never try a CUDA/ROCm build.
    unset HOROVOD_GPU HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST

    pip_install_horovod() {
        log "MAKEFLAGS=$MAKEFLAGS; pip install horovod==$HOROVOD_VERSION (a build from source takes ~6-11 min on 2 cores; pip then caches the wheel)"
        local start=$SECONDS
        "$PYTHON" -m pip install --no-build-isolation "$@" "horovod==$HOROVOD_VERSION"
        log "pip install took $((SECONDS - start)) s"
    }
    # An unusable horovod (other version, built without MPI/Gloo or for another
    # torch) is uninstalled and rebuilt. pip's wheel cache is keyed on the sdist,
    # not on the torch the wheel was built against, so cached horovod wheels are
    # dropped too before such a rebuild.
    remove_horovod() {
        log "uninstalling horovod and removing cached horovod wheels from pip's cache"
        "$PYTHON" -m pip uninstall -y horovod
        "$PYTHON" -m pip cache remove horovod || true
    }

    rebuilt=0
    if [ "$STATUS" != "horovod not installed" ]; then
        remove_horovod
        rebuilt=1
    fi
    pip_install_horovod
    STATUS="$(horovod_status)"
    if [ "$STATUS" != "ok" ] && [ "$rebuilt" = 0 ]; then
        # Most likely pip reused a cached wheel built for another torch.
        log "installed horovod is unusable ($STATUS)"
        remove_horovod
        pip_install_horovod
    fi
fi

# --- check --------------------------------------------------------------------
HOROVODRUN="$SCRIPTS_DIR/horovodrun"
[ -x "$HOROVODRUN" ] || HOROVODRUN="$(command -v horovodrun 2>/dev/null || true)"
[ -n "$HOROVODRUN" ] || die "horovodrun not found in $SCRIPTS_DIR nor on PATH after install"
CHECK_OUT="$("$HOROVODRUN" --check-build 2>&1)" || {
    echo "$CHECK_OUT" >&2
    die "'$HOROVODRUN --check-build' failed"
}
echo "$CHECK_OUT"

# Each required (section, item) must be marked [X].
MISSING="$(printf '%s\n' "$CHECK_OUT" | awk '
    /^[[:space:]]*Available .*:[[:space:]]*$/ { sub(/^[[:space:]]*Available /, ""); sub(/:[[:space:]]*$/, ""); section = $0; next }
    /\[X\]/ { item = $0; sub(/^.*\[X\][[:space:]]*/, "", item); sub(/[[:space:]]*$/, "", item); have[section "/" item] = 1 }
    END {
        r[1] = "Frameworks/PyTorch"; r[2] = "Controllers/MPI"; r[3] = "Controllers/Gloo"
        r[4] = "Tensor Operations/MPI"; r[5] = "Tensor Operations/Gloo"
        for (i = 1; i <= 5; i++) if (!(r[i] in have)) printf "%s%s", (out++ ? ", " : ""), r[i]
        print ""
    }')"
if [ -n "$MISSING" ]; then
    die "horovod $HOROVOD_VERSION is installed but not built with: $MISSING (see check output above). Make sure torch, a C++ compiler, cmake and MPI (pip install mpi4py mpich) are installed, then rerun this script."
fi
log "OK: horovod $HOROVOD_VERSION with PyTorch, MPI and Gloo is installed for $PYTHON"
