#!/usr/bin/env bash
# Build (or reuse a cached build of) Horovod 0.28.1 with TensorFlow + Gloo
# (no MPI, no PyTorch, no MXNet, no GPU) and install it into a venv.
#
# Usage: tools/build_horovod.sh VENV_DIR WHEEL_CACHE_DIR
#
# Assumes VENV_DIR/bin/pip exists and requirements/tf215.txt (or another set
# with tensorflow-cpu, cmake<4, setuptools, wheel, packaging, psutil, pyyaml,
# cloudpickle) is already installed in it.
#
# Cache layout (one wheel per Horovod version x TF version x Python/platform):
#   WHEEL_CACHE_DIR/horovod-0.28.1/src/horovod-0.28.1.tar.gz      (sdist, reused offline)
#   WHEEL_CACHE_DIR/horovod-0.28.1/tf-<TFVER>-<cpXY>-<platform>/
#       horovod-0.28.1-<cpXY>-<cpXY>-<platform>.whl
#       BUILD_INFO       (stamp: TF/numpy/gcc/cmake versions, build time)
#       build.log        (full pip/cmake output of the build)
# A TF bump changes <TFVER>, so the next run builds a fresh wheel.
# Don't edit this file while a run of it is in progress (bash reads it lazily).
#
# Environment knobs:
#   HOROVOD_VERSION   (default 0.28.1)
#   BUILD_JOBS        (default: nproc) parallel compile jobs
#   FORCE_REBUILD=1   ignore the cached wheel and rebuild it
#   HVD_CONSTRAINTS   pin file for the runtime deps (default:
#                     requirements/tf<major><minor>.txt for the venv's TF)
#   HVD_CHECK_BUILD=0 skip `horovodrun --check-build` (~10 forked TF imports);
#                     a one-process import + hvd.init() check still runs
set -euo pipefail

HVD_VERSION="${HOROVOD_VERSION:-0.28.1}"

log() { printf '[build_horovod] %s\n' "$*"; }
die() { printf '[build_horovod] ERROR: %s\n' "$*" >&2; exit 1; }

[ $# -eq 2 ] || die "usage: $0 VENV_DIR WHEEL_CACHE_DIR"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -d "$1" ] || die "venv dir $1 not found: create it first (python3 -m venv $1 && $1/bin/pip install -r requirements/tf215.txt)"
VENV="$(cd "$1" && pwd)"
CACHE_ROOT="$(mkdir -p "$2" && cd "$2" && pwd)"
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"
[ -x "$PY" ] || die "$PY not found: create the venv first (python3 -m venv $VENV)"
[ -x "$PIP" ] || die "$PIP not found: create the venv first"
T0=$(date +%s)


# --- What are we building against? (no TF import: fast) ----------------------
read -r TF_VER PY_TAG PLAT < <("$PY" - <<'EOF'
import importlib.metadata as md, sys, sysconfig
tf = None
for dist in ("tensorflow-cpu", "tensorflow", "tensorflow-intel", "tensorflow-gpu"):
    try:
        tf = md.version(dist)
        break
    except md.PackageNotFoundError:
        pass
print(tf or "none",
      "cp%d%d" % sys.version_info[:2],
      sysconfig.get_platform().replace("-", "_").replace(".", "_"))
EOF
)
[ -n "${TF_VER:-}" ] || die "could not query $PY for its TensorFlow/Python versions"
[ "$TF_VER" != "none" ] || die "no tensorflow / tensorflow-cpu installed in $VENV (install requirements/tf215.txt first)"

# Pinned set used as a constraints file for Horovod's runtime deps:
# requirements/tf<major><minor>.txt matching the venv's TF (tf215.txt for 2.15.x).
_tfmm="$(echo "$TF_VER" | awk -F. '{print $1 $2}')"
CONSTRAINTS="${HVD_CONSTRAINTS:-$REPO_ROOT/requirements/tf${_tfmm}.txt}"

HVD_CACHE="$CACHE_ROOT/horovod-$HVD_VERSION"
KEY_DIR="$HVD_CACHE/tf-$TF_VER-$PY_TAG-$PLAT"
SRC_DIR="$HVD_CACHE/src"
WHEEL_GLOB="horovod-$HVD_VERSION-$PY_TAG-*.whl"
log "horovod $HVD_VERSION | tensorflow $TF_VER | $PY_TAG | $PLAT"
log "cache dir: $KEY_DIR"
mkdir -p "$KEY_DIR" "$SRC_DIR"

# Serialise concurrent runs on the same cache.
exec 9>"$HVD_CACHE/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9 || die "could not lock $HVD_CACHE/.lock"
fi

find_wheel() { compgen -G "$KEY_DIR/$WHEEL_GLOB" | head -n1 || true; }

WHEEL="$(find_wheel)"
if [ -n "$WHEEL" ] && [ "${FORCE_REBUILD:-0}" != "1" ]; then
    if "$PY" -m zipfile -t "$WHEEL" >/dev/null 2>&1; then
        log "cache hit: $(basename "$WHEEL")"
    else
        log "cached wheel $WHEEL is corrupt: removing and rebuilding"
        rm -f "$WHEEL"; WHEEL=""
    fi
else
    [ -n "$WHEEL" ] && { log "FORCE_REBUILD=1: discarding $(basename "$WHEEL")"; rm -f "$WHEEL"; }
    WHEEL=""
fi

if [ -z "$WHEEL" ]; then
    log "cache miss: building horovod $HVD_VERSION from source against tensorflow $TF_VER"

    # CMake: >=3.13 (Horovod) and <4 (gloo's CMakeLists is rejected by CMake 4).
    CMAKE_BIN=""
    for c in "$VENV/bin/cmake" "$(command -v cmake || true)"; do
        [ -n "$c" ] && [ -x "$c" ] || continue
        v="$("$c" --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9.]*\).*/\1/p')"
        major="${v%%.*}"; rest="${v#*.}"; minor="${rest%%.*}"
        if [ -n "$v" ] && [ "$major" -eq 3 ] && [ "$minor" -ge 13 ]; then
            CMAKE_BIN="$c"; log "using cmake $v ($c)"; break
        fi
        log "skipping cmake $v at $c (need >=3.13,<4)"
    done
    [ -n "$CMAKE_BIN" ] || die "no CMake >=3.13,<4 found: pip install 'cmake<4' into $VENV (it is pinned in requirements/tf215.txt)"
    command -v "${CXX:-g++}" >/dev/null 2>&1 || die "no C++ compiler (${CXX:-g++}) on PATH: apt-get install g++"
    command -v make >/dev/null 2>&1 || die "make not on PATH: apt-get install make"

    # Build-time Python deps that --no-build-isolation expects in the venv.
    "$PY" -c "import setuptools, wheel, packaging, psutil, yaml, cloudpickle" 2>/dev/null \
        || die "build deps missing in $VENV (setuptools wheel packaging psutil pyyaml cloudpickle): install requirements/tf215.txt"

    # sdist: reuse the cached one so a rebuild needs no network.
    SDIST="$(compgen -G "$SRC_DIR/horovod-$HVD_VERSION.tar.gz" | head -n1 || true)"
    if [ -z "$SDIST" ]; then
        log "downloading horovod-$HVD_VERSION sdist from PyPI"
        "$PIP" download --no-deps --no-binary :all: --no-build-isolation \
            "horovod==$HVD_VERSION" -d "$SRC_DIR" >"$SRC_DIR/download.log" 2>&1 \
            || { tail -n 20 "$SRC_DIR/download.log" >&2; die "sdist download failed (log: $SRC_DIR/download.log)"; }
        SDIST="$SRC_DIR/horovod-$HVD_VERSION.tar.gz"
        [ -f "$SDIST" ] || die "sdist not found after download in $SRC_DIR"
    fi

    JOBS="${BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
    TMP_OUT="$(mktemp -d "$KEY_DIR/.tmp-build.XXXXXX")"

    # Newer TF wheels (seen with 2.21) broke horovod 0.28.1's xla_mpi_ops.cc:
    # XLA headers moved (tensorflow/compiler/xla/client/xla_builder.h is now
    # xla/hlo/builder/xla_builder.h) and pull highwayhash/farmhash headers that
    # the wheel ships under include/external/ but not on its include path.
    # Only when the old header is absent: add a forwarding shim plus those dirs
    # via CPLUS_INCLUDE_PATH (searched after -I/-isystem, so nothing shadowed).
    EXTRA_INC=""
    TF_INC="$("$PY" -c 'import os, importlib.util as u; print(os.path.join(os.path.dirname(u.find_spec("tensorflow").origin), "include"))')"
    if [ ! -f "$TF_INC/tensorflow/compiler/xla/client/xla_builder.h" ] \
       && [ -f "$TF_INC/xla/hlo/builder/xla_builder.h" ]; then
        SHIM="$TMP_OUT/shim-include"
        mkdir -p "$SHIM/tensorflow/compiler/xla/client"
        echo '#include "xla/hlo/builder/xla_builder.h"' \
            >"$SHIM/tensorflow/compiler/xla/client/xla_builder.h"
        EXTRA_INC="$SHIM"
        for d in "$TF_INC/external/highwayhash" "$TF_INC/external/farmhash_archive/src"; do
            [ -d "$d" ] && EXTRA_INC="$EXTRA_INC:$d"
        done
        log "TF $TF_VER has the new XLA header layout: using include shim + $EXTRA_INC"
    fi
    INC_ENV=()
    [ -n "$EXTRA_INC" ] && INC_ENV=("CPLUS_INCLUDE_PATH=${EXTRA_INC}${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}")
    BUILD_LOG="$KEY_DIR/build.log"
    log "compiling with $JOBS jobs (about 4 min on 2 cores); full log: $BUILD_LOG"
    B0=$(date +%s)
    # --no-cache-dir: pip's own wheel cache is keyed on the sdist only, not on
    # the TF version, so it could hand back a wheel built against another TF.
    set +e
    env -u HOROVOD_GPU -u HOROVOD_GPU_OPERATIONS -u HOROVOD_WITH_MPI \
        PATH="$VENV/bin:$PATH" \
        "${INC_ENV[@]}" \
        HOROVOD_CMAKE="$CMAKE_BIN" \
        HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j$JOBS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$PIP" wheel -v --no-cache-dir --no-build-isolation --no-deps \
            "$SDIST" -w "$TMP_OUT" >"$BUILD_LOG" 2>&1 &
    BPID=$!
    while kill -0 "$BPID" 2>/dev/null; do
        sleep 30
        kill -0 "$BPID" 2>/dev/null || break
        step="$(grep -o '\[ *[0-9]*%\]' "$BUILD_LOG" | tail -n1 || true)"
        log "  ... still building ($(( $(date +%s) - B0 ))s) ${step}"
    done
    wait "$BPID"; rc=$?
    set -e
    if [ $rc -ne 0 ]; then
        echo "----- last 40 lines of $BUILD_LOG -----" >&2
        tail -n 40 "$BUILD_LOG" >&2
        grep -n -m5 -E 'error:|fatal error|CMake Error' "$BUILD_LOG" >&2 || true
        rm -rf "$TMP_OUT"
        die "horovod build failed (exit $rc) after $(( $(date +%s) - B0 ))s; see $BUILD_LOG"
    fi
    BUILT="$(compgen -G "$TMP_OUT/$WHEEL_GLOB" | head -n1 || true)"
    [ -n "$BUILT" ] || { rm -rf "$TMP_OUT"; die "pip wheel succeeded but produced no $WHEEL_GLOB in $TMP_OUT"; }
    # The TF extension must be inside, or the build silently skipped TF.
    "$PY" - "$BUILT" <<'EOF' || { rm -rf "$TMP_OUT"; die "built wheel lacks horovod/tensorflow/mpi_lib*.so (TF extension not built)"; }
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(0 if any(n.startswith("horovod/tensorflow/mpi_lib") and n.endswith(".so") for n in names) else 1)
EOF
    mv -f "$BUILT" "$KEY_DIR/"
    rm -rf "$TMP_OUT"
    WHEEL="$KEY_DIR/$(basename "$BUILT")"
    {
        echo "horovod=$HVD_VERSION"
        echo "tensorflow=$TF_VER"
        echo "python=$("$PY" -c 'import sys; print(sys.version.split()[0])')"
        echo "numpy=$("$PY" -c 'import importlib.metadata as m; print(m.version("numpy"))' 2>/dev/null || echo none)"
        echo "platform=$PLAT"
        echo "cxx=$("${CXX:-g++}" --version | head -n1)"
        echo "cmake=$("$CMAKE_BIN" --version | head -n1)"
        echo "build_seconds=$(( $(date +%s) - B0 ))"
        echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "extra_cplus_include_path=${EXTRA_INC:-none}"
        echo "env=HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1"
    } >"$KEY_DIR/BUILD_INFO"
    log "built $(basename "$WHEEL") in $(( $(date +%s) - B0 ))s"
fi

# --- Install -------------------------------------------------------------------
log "installing runtime deps (cloudpickle psutil pyyaml packaging)"
DEPS_ARGS=(cloudpickle psutil pyyaml packaging)
if [ -f "$CONSTRAINTS" ]; then DEPS_ARGS=(-c "$CONSTRAINTS" "${DEPS_ARGS[@]}"); fi
"$PIP" install -q --disable-pip-version-check "${DEPS_ARGS[@]}" \
    || die "could not install horovod runtime deps"
# Skip the reinstall when the venv already holds exactly this wheel (pip records
# the wheel's URL and sha256 in horovod's direct_url.json).
if "$PY" - "$WHEEL" <<'EOF' 2>/dev/null
import hashlib, importlib.metadata as md, json, pathlib, sys
whl = pathlib.Path(sys.argv[1]).resolve()
info = json.loads(md.distribution("horovod").read_text("direct_url.json") or "{}")
want = "sha256=" + hashlib.sha256(whl.read_bytes()).hexdigest()
ok = info.get("url") == whl.as_uri() and info.get("archive_info", {}).get("hash") == want
sys.exit(0 if ok else 1)
EOF
then
    log "$(basename "$WHEEL") already installed in $VENV: skipping reinstall"
else
    log "installing $(basename "$WHEEL") (--no-deps)"
    "$PIP" install -q --disable-pip-version-check --no-deps --force-reinstall "$WHEEL" \
        || die "pip install of $WHEEL failed"
fi

# --- Verify --------------------------------------------------------------------
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
if [ "${HVD_CHECK_BUILD:-1}" != "0" ]; then
    # horovodrun --check-build forks ~10 children that each import TF: ~13 s on
    # an idle 2-core box. HVD_CHECK_BUILD=0 keeps only the one-process check below.
    # Note: 0.28.1 shows "[X] PyTorch" even without torch (horovod.torch imports
    # with only a warning when its extension is absent); TensorFlow + Gloo matter.
    log "verifying: horovodrun --check-build"
    CHECK="$("$VENV/bin/horovodrun" --check-build 2>&1)" || { echo "$CHECK" >&2; die "horovodrun --check-build failed"; }
    grep -v -E 'oneDNN|absl::InitializeLog|cpu_feature_guard|To enable the following instructions' <<<"$CHECK" || true
    grep -q '\[X\] TensorFlow' <<<"$CHECK" || die "TensorFlow support missing from the installed horovod"
    grep -q '\[X\] Gloo' <<<"$CHECK" || die "Gloo support missing from the installed horovod"
fi
"$PY" - <<'EOF' 2>&1 | grep -v -E 'oneDNN|absl::InitializeLog|cpu_feature_guard|To enable the following instructions' \
    || die "import horovod.tensorflow / hvd.init() failed"
import horovod, horovod.tensorflow as hvd
assert hvd.gloo_built(), "horovod.tensorflow was not built with Gloo"
hvd.init()
assert hvd.size() == 1 and hvd.gloo_enabled(), (hvd.size(), hvd.gloo_enabled())
print("[build_horovod] import horovod.tensorflow OK: version %s, gloo_built=%s, mpi_built=%s, hvd.init() size=1"
      % (horovod.__version__, hvd.gloo_built(), hvd.mpi_built()))
EOF
log "done in $(( $(date +%s) - T0 ))s"
