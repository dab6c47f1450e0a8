#!/usr/bin/env bash
# Builds the CUDA sparse MLA kernels (pallas_kernels/sparse_mla/cuda/*.cu: the forward over bf16
# rows and paged FP8 rows, and the backward's dq and dkv kernels) into
# build/cuda/libglm_sparse_mla.so, the library pallas_kernels.sparse_mla.cuda loads (impl="cuda").
#
#   scripts/build_cuda_kernels.sh
#
# Needs nvcc (CUDA >= 12.4; NVCC=/path/to/nvcc to pick one) and the XLA FFI headers of the
# jaxlib the library will run under: FFI_INCLUDE=DIR (a jaxlib/include folder), else those of
# jaxlib $JAXLIB_VERSION (default 0.11.2, the GPU machines' version), downloaded once with pip
# into build/cuda/jaxlib-$JAXLIB_VERSION (its headers kept, the wheel removed). Compiles for sm_90a (H100 / H200); prints ptxas's
# registers, shared memory and spills of every kernel and fails if one spills.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT_DIR:-$ROOT/build/cuda}"
NVCC="${NVCC:-nvcc}"
JAXLIB_VERSION="${JAXLIB_VERSION:-0.11.2}"
ARCH="${CUDA_ARCH:-sm_90a}"
SOURCES=("$ROOT"/pallas_kernels/sparse_mla/cuda/*.cu)
LIB="$OUT_DIR/libglm_sparse_mla.so"

die() { echo "build_cuda_kernels.sh: $*" >&2; exit 1; }

command -v "$NVCC" >/dev/null 2>&1 || die "nvcc not found ('$NVCC' is not on PATH): install the CUDA toolkit (>= 12.4) or set NVCC=/path/to/nvcc"
[ -e "${SOURCES[0]}" ] || die "no CUDA sources under $ROOT/pallas_kernels/sparse_mla/cuda"
mkdir -p "$OUT_DIR"

if [ -z "${FFI_INCLUDE:-}" ]; then
  FFI_INCLUDE="$OUT_DIR/jaxlib-$JAXLIB_VERSION/jaxlib/include"
  if [ ! -f "$FFI_INCLUDE/xla/ffi/api/ffi.h" ]; then
    PY="${PYTHON:-python3}"
    WHEELS="$OUT_DIR/jaxlib-$JAXLIB_VERSION"
    mkdir -p "$WHEELS"
    echo "build_cuda_kernels.sh: fetching the FFI headers of jaxlib $JAXLIB_VERSION into $WHEELS"
    "$PY" -m pip download "jaxlib==$JAXLIB_VERSION" --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_27_x86_64 -d "$WHEELS" -q >/dev/null 2>&1 \
      && "$PY" - "$WHEELS" <<'PYEOF' || true
import glob, sys, zipfile
wheel = sorted(glob.glob(sys.argv[1] + "/jaxlib-*.whl"))[-1]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[1], [n for n in z.namelist() if n.startswith("jaxlib/include/")])
PYEOF
    rm -f "$WHEELS"/jaxlib-*.whl   # only the headers are kept (build/cuda stays a few MiB)
  fi
fi
[ -f "$FFI_INCLUDE/xla/ffi/api/ffi.h" ] || die "XLA FFI headers not found ($FFI_INCLUDE/xla/ffi/api/ffi.h): set FFI_INCLUDE to a jaxlib/include folder (python -c 'import jax; print(jax.ffi.include_dir())') or let pip download jaxlib==$JAXLIB_VERSION"

LOG="$OUT_DIR/ptxas.log"
echo "build_cuda_kernels.sh: $NVCC for $ARCH, FFI headers $FFI_INCLUDE"
# both the PTX and the code for the architecture-specific target (sm_90a: wgmma, setmaxnreg)
if ! "$NVCC" -std=c++17 -O3 -gencode "arch=compute_${ARCH#sm_},code=$ARCH" -shared -Xcompiler -fPIC -Xptxas -v -lineinfo \
    -I"$FFI_INCLUDE" -I"$ROOT/pallas_kernels/sparse_mla/cuda" -o "$LIB.tmp" "${SOURCES[@]}" >"$LOG" 2>&1; then
  cat "$LOG" >&2
  die "nvcc failed (log above, also in $LOG)"
fi
mv "$LIB.tmp" "$LIB"
# one line per kernel: its template arguments (block_k, stages, paged, fp8 rows, out type), registers,
# spills; then the dynamic shared memory of each (block_k, stages) (Layout in the source)
FILT=cat; command -v c++filt >/dev/null 2>&1 && FILT=c++filt
awk '/Compiling entry function/ {name=$0; sub(/.*function .?/, "", name); sub(/.? for .*/, "", name)}
     /bytes stack frame/ {match($0, /[0-9]+ bytes spill stores, [0-9]+ bytes spill loads/); spill=substr($0, RSTART, RLENGTH)}
     /Used [0-9]+ registers/ {match($0, /Used [0-9]+ registers/); print name "\t" substr($0, RSTART, RLENGTH) ", " spill}' "$LOG" \
  | "$FILT" | sed -E 's/^(void )?glm_sparse_mla::(bwd::|sm90::)?(sparse_mla_[a-z0-9_]+_kernel)/  \3/; s/\(glm_sparse_mla::(bwd::|sm90::)?[A-Za-z]*Params\)//; s/__nv_bfloat16/bf16/'
for cfg in "64 2" "32 3" "32 4"; do
  set -- $cfg
  echo "  forward block_k=$1 stages=$2: $(( 64 * 1152 + $2 * $1 * 1152 + 64 * ($1 + 8) * 2 + 6 * 64 * 4 + $2 * $1 )) bytes of dynamic shared memory (of 232448)"
done
# the warpgroup forward (FwdLayout in sparse_mla_fwd_sm90.cu): Q + 2 buffers of 64 rows, alpha,
# l, m, 7 barriers, 1024 bytes of alignment; its registers a thread by warpgroup: 240 / 160 / 72
echo "  forward sm90 (wgmma): $(( 3 * 64 * 1152 + 4 * 64 * 4 + 7 * 8 + 1024 )) bytes of dynamic shared memory (of 232448)"
# its indexer target pass (TargetLayout): Q + 2 buffers, the column sums [2][4][64] f32, 5 barriers
echo "  target sm90 (wgmma): $(( 3 * 64 * 1152 + 2 * 4 * 64 * 4 + 5 * 8 + 1024 )) bytes of dynamic shared memory (of 232448)"
# FP8 rows (paged): one bf16 tile of 32 rows + a ring of stages x 32 staged rows of 656 bytes
for stages in 3 4; do
  echo "  forward fp8 block_k=32 stages=$stages: $(( 64 * 1152 + 32 * 1152 + stages * 32 * 656 + 64 * 40 * 2 + 6 * 64 * 4 + stages * 32 )) bytes of dynamic shared memory (of 232448)"
done
# backward (DqLayout in sparse_mla_bwd_dq.cu, DkvLayout in sparse_mla_bwd_dkv.cu): dq Q + dO + 2 x 32 gathered rows + dS
# [64][40] + lse, delta + valid flags; dkv 32 rows + 2 x (Q [32][576] + dO [32][512] + lse,
# delta, counts) + P^T, dS^T [32][40] bf16 + the S, dP partials [2][4][32][40] f32
echo "  dq: $(( 64 * 1152 + 64 * 1024 + 2 * 32 * 1152 + 64 * 40 * 2 + 2 * 64 * 4 + 2 * 32 )) bytes, dkv: $(( 32 * 1152 + 2 * (32 * 1152 + 32 * 1024 + 3 * 128) + 2 * 32 * 40 * 2 + 2 * 4 * 32 * 40 * 4 )) bytes of dynamic shared memory (of 232448)"
if grep -E "[1-9][0-9]* bytes spill (stores|loads)" "$LOG" >/dev/null; then
  die "a kernel spills registers (above); the library was still written to $LIB"
fi
echo "build_cuda_kernels.sh: wrote $LIB"
