#!/usr/bin/env bash
# Train the next default model (configs/default-py.yaml, docs/default-model.md) on a GPU machine
# in calls of at most MINUTES of wall time each, and pack what comes back.
#
#   bash scripts/gpu_default_model.sh [--smoke] OUT_DIR [MINUTES] [-- TRAIN_FLAGS...]
#   bash scripts/gpu_default_model.sh --parts FIRST-LAST OUT_DIR     # more weight parts, no training
#
# Each call, in runs/ (git-ignored, kept between calls on the same machine):
# 1. installs grain from wheels/ if it does not import (scripts/gpu_wheels.sh fills wheels/ on a
#    machine that reaches a package index; carry wheels/ to the GPU machine);
# 2. builds the corpus runs/pycorpus from the interpreter's site-packages unless it is there
#    (scripts/build_python_corpus.py; packages held out by a hash of their name);
# 3. runs train.py with the recipe of docs/default-model.md and --resume, under a time limit
#    that leaves room for the rest: at the limit SIGTERM makes train.py save a checkpoint after
#    its step and exit, and the next call continues from it exactly (same machine only: the
#    checkpoint, with optimizer state about 210 MB, stays in runs/default-py/checkpoints/);
#    TRAIN_FLAGS are appended (the last value of a repeated flag wins, e.g. -- --steps 1500);
# 4. exports the newest checkpoint as runs/default-py/params/ in bfloat16 (train.py itself
#    exports when it reaches --steps) and packs it, with config.yaml and tokenizer.json, into
#    parts of 15 MiB: default_model_params.tar.part-00, -01, ...;
# 5. writes OUT_DIR/default_model.tar.gz (metrics.jsonl, the train logs, config.yaml,
#    tokenizer.json, the corpus manifest, status.txt with the step, the parts and their
#    sha256) and copies parts 00-02 to OUT_DIR (the default model's 27 MB export is 2 parts);
#    any more come with a second call: --parts 3-6. Rebuild: cat default_model_params.tar.part-* > params.tar,
#    check its sha256 against status.txt, tar -xf params.tar -C checkpoints/default-py.
# MINUTES (default 9) bounds the whole call. --smoke does all of it on the CPU at a tiny size:
# a corpus of four small packages, configs/tiny.yaml, a few steps (runs/*-smoke).
# PYTHON (default python3) is the interpreter; RUNS_DIR (default runs) holds the work.
# Exit status 1 if a step failed.
set -uo pipefail

usage() {
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 2
}
fail() { echo "error: $*" >&2; exit 2; }

smoke=0
parts=""
while [ $# -gt 0 ]; do
    case $1 in
        --smoke) smoke=1; shift ;;
        --parts)
            [[ ${2:-} =~ ^[0-9]+-[0-9]+$ ]] || fail "--parts needs FIRST-LAST, e.g. 3-6"
            parts=$2; shift 2 ;;
        -h|--help) usage ;;
        -*) echo "unknown option '$1'" >&2; usage ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || usage
out=$1
shift
minutes=9
if [ $# -gt 0 ] && [ "$1" != -- ]; then
    [[ $1 =~ ^[0-9]+(\.[0-9]+)?$ ]] || fail "MINUTES must be a number, not '$1'"
    minutes=$1
    shift
fi
extra=()
if [ $# -gt 0 ]; then
    [ "$1" = -- ] || fail "unexpected '$1' (train.py flags go after --)"
    shift
    extra=("$@")
fi

cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
runs=$(mkdir -p "${RUNS_DIR:-runs}" && cd "${RUNS_DIR:-runs}" && pwd)
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$runs/jax_cache}  # a later call skips compiling
py=${PYTHON:-python3}
suffix=""
if [ $smoke = 1 ]; then
    export JAX_PLATFORMS=cpu
    suffix=-smoke
fi
run=$runs/default-py$suffix
corpus=$runs/pycorpus$suffix
packed=$run-packed
mkdir -p "$out"

copy_parts() {   # copy_parts FIRST LAST: the weight parts FIRST..LAST into OUT_DIR
    local i name missing=0
    for ((i = $1; i <= $2; i++)); do
        name=$(printf 'default_model_params.tar.part-%02d' "$i")
        if [ -f "$packed/$name" ]; then
            cp "$packed/$name" "$out/"
        else
            echo "no $packed/$name" >&2
            missing=1
        fi
    done
    return $missing
}
if [ -n "$parts" ]; then
    copy_parts "${parts%-*}" "${parts#*-}" || exit 1
    ls -l "$out"
    exit 0
fi

start=$SECONDS
deadline=$((start + $(awk -v m="$minutes" 'BEGIN {printf "%d", m * 60}')))
reserve=180     # seconds kept for train.py's last step and save, the export and the packing
failed=0
log=$run/train-$(date -u +%Y%m%dT%H%M%SZ).log
left() { echo $((deadline - SECONDS - reserve)); }
mkdir -p "$run"

echo "== grain, tyro"
source scripts/_gpu_deps.sh
need_python_packages "$py" grain tyro || fail "train.py needs grain and tyro"

echo "== corpus $corpus"
if [ ! -f "$corpus/manifest.json" ]; then
    corpus_args=(--out "$corpus")
    if [ $smoke = 1 ]; then
        site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        rm -rf "$corpus-site" && mkdir -p "$corpus-site"
        for p in einops tqdm toolz zipp; do cp -r "$site/$p" "$corpus-site/"; done
        corpus_args+=(--site-packages "$corpus-site" --heldout-fraction 0.5)
    fi
    [ "$(left)" -ge 30 ] || fail "no time left for the corpus in $minutes minutes"
    timeout "$(left)" "$py" scripts/build_python_corpus.py "${corpus_args[@]}" 2>&1 | tee "$run/corpus.log"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "corpus build failed" >&2; rm -rf "$corpus"; exit 1; }
fi

train_args=(--config configs/default-py.yaml --out "$run" --data "$corpus/train.jsonl"
            --heldout-data "$corpus/heldout.jsonl" --seq-len 4096 --batch-size 16 --remat --steps 1800
            --dense-steps 300 --lr 1.5e-3 --warmup-steps 200 --decay-steps 360 --mtp-depth 3 --mtp-weight 0.3
            --tv-weight 0.5 --eval-every 250 --save-every 250 --log-every 50 --export-dtype bfloat16 --resume)
[ $smoke = 1 ] && train_args+=(--config configs/tiny.yaml --seq-len 64 --batch-size 2 --steps 4 --dense-steps 2
                               --warmup-steps 1 --eval-every 2 --save-every 2 --eval-batches 1 --log-every 1)
train_args+=("${extra[@]}")
limit=$(left)
echo "== train.py for at most ${limit}s (log $log): ${train_args[*]}"
if [ "$limit" -lt 60 ]; then
    echo "less than a minute left for training: skipped" | tee "$log"
    failed=1
else
    timeout --preserve-status --signal=TERM --kill-after=90 "$limit" "$py" train.py "${train_args[@]}" 2>&1 \
        | tee "$log"
    status=${PIPESTATUS[0]}
    [ "$status" = 0 ] || { echo "train.py exited with status $status" >&2; failed=1; }
fi

echo "== export"
if grep -q '^done:' "$log"; then
    echo "train.py reached --steps and exported params/"
    step=$(sed -n 's/^done: \([0-9]*\) steps.*/\1/p' "$log")
elif "$py" scripts/export_checkpoint.py "$run" --dtype bfloat16 2>&1 | tee "$run/export.log"; then
    step=$(sed -n 's/^exported step \([0-9]*\).*/\1/p' "$run/export.log")
else
    echo "export failed (no checkpoint yet?)" >&2
    step=none
    failed=1
fi

echo "== pack"
rm -rf "$packed" && mkdir -p "$packed"
if [ -d "$run/params" ]; then
    tar -cf "$packed/params.tar" -C "$run" config.yaml tokenizer.json params $(cd "$run" && ls params.files.json 2>/dev/null)
    sha=$(sha256sum "$packed/params.tar" | cut -d' ' -f1)
    split -b 15M -d -a 2 "$packed/params.tar" "$packed/default_model_params.tar.part-"
    rm "$packed/params.tar"
fi
nparts=$(find "$packed" -name 'default_model_params.tar.part-*' | wc -l)
report=$packed/default_model
mkdir -p "$report"
{
    echo "date: $(date -u +%FT%TZ); commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no .git)')"
    echo "exported step: $step; finished (reached --steps): $(grep -q '^done:' "$log" && echo yes || echo no)"
    echo "weight parts: $nparts (default_model_params.tar.part-00..), params.tar sha256: ${sha:-none}"
    echo "this call: $((SECONDS - start)) s of at most $((deadline - start)) s; train.py flags: ${train_args[*]}"
    echo "python: $("$py" -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.devices())' 2>&1 | tail -1)"
} > "$report/status.txt"
for f in "$run"/metrics.jsonl "$run"/config.yaml "$run"/tokenizer.json "$run"/train-*.log "$run"/corpus.log \
         "$corpus"/manifest.json; do
    [ -f "$f" ] && cp "$f" "$report/"
done
tar -czf "$out/default_model.tar.gz" -C "$packed" default_model
[ "$nparts" -gt 0 ] && { copy_parts 0 $((nparts < 3 ? nparts - 1 : 2)) || failed=1; }
cat "$report/status.txt"
[ "$nparts" -gt 3 ] && echo "parts 03-$(printf %02d $((nparts - 1))) stay in $packed: fetch them with --parts 3-$((nparts - 1))"
ls -l "$out"
exit $failed
