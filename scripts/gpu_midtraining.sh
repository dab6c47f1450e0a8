#!/usr/bin/env bash
# Long-context mid-training of the default model on one GPU (docs/training.md, "Long-context
# mid-training (32K, then 128K)"), in calls of at most 10 minutes each: every training call stops
# itself (SIGTERM: train.py saves a checkpoint and exits) before 9.5 minutes, and the next call
# of the same subcommand continues it with --resume.
#
#   bash scripts/gpu_midtraining.sh SUBCOMMAND
#
# Carry wheels/ (scripts/gpu_wheels.sh): grain and tyro are installed from it where they do not import.
#
# SUBCOMMAND   what it does
# data         long documents: each package of the environment's site-packages as one
#              document, 3 long packages held out (RUNS_DIR/long/{train,heldout}.jsonl), recall
#              pairs (a made-up constant defined, used again far later) in the training ones
# stage32k     checkpoints/default extended to 32,768 positions (YaRN), trained sparse from
#              the first step on 32K-token rows (call again until it says done)
# stage128k    the 32K stage's weights extended to 131,072 positions, trained on 128K rows
# kill-resume  at 32K: a short uninterrupted run, the same run killed (SIGKILL) mid-step and
#              during an asynchronous save, each resumed; the losses compared bit for bit
# eval         held-out bits per token by position bucket and the retrieval probe (2K, 16K, 64K
#              and 100K tokens from the definition) in 128K rows for
#              checkpoints/default, the 32K and the 128K stage, and each shorter model extended
#              to 128K by YaRN without training (the row the trained extension must beat)
# speed [LEN]  train.py's steady tokens/s and peak memory at 32K and 128K (or LEN tokens only),
#              sparse (12 steps) against a dense run of the same model (3 steps: a dense step
#              at 128K takes about a minute); each run within what is left of the call's 9.5 min
# retrieval    the indexer-selection ablation at 32K (docs/training.md, "The second run"): for
#              each variant of RETRIEVAL_VARIANTS (NAME=RECALL_EVERY:INDEXER_LR_SCALE ..., default
#              "recall2000=2000:1 recall2000-lr10=2000:10"), in RUNS_DIR/retrieval/NAME: its data,
#              a 32K stage from checkpoints/default (STEPS_32K, TOPK_32K default 2048, DENSE_32K
#              default 100), then the probe at 2,048 and 16,384 tokens; each variant done once,
#              as far as the call's BUDGET_S (585) goes; call again to go on
# all          the above in order (data, stage32k, stage128k, eval, kill-resume, speed 131072,
#              speed 32768), each finished step once, as far as the call's BUDGET_S (585) goes; a
#              stage out of memory goes on with --remat; call again on the same machine to go on;
#              COPY_TO=DIR: the logs and metrics so far packed into DIR/midtraining.tar.gz
#
# Environment: PYTHON (default python3), RUNS_DIR (default /root/runs: outside the repository),
# JAX_COMPILATION_CACHE_DIR (default /root/jaxcache), STEPS_32K / STEPS_128K (default 300 / 150),
# DENSE_32K / DENSE_128K (of those, the dense steps first: the indexer learns the attention over
# every key, not only over the keys it already selects; default 0 / 0), TOPK_32K / TOPK_128K (the
# indexer's top-k in each stage, --index-topk; default: the model's),
# LR (default 3e-4), RECALL_EVERY (characters of training text a recall pair, default 20000),
# LIMIT_S (seconds a training call runs before it stops itself, default 540),
# MID_FLAGS (more train.py flags for every run, e.g. --remat where a stage does not fit the card).
set -uo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
[ $# -eq 1 ] || { [ $# -eq 2 ] && [ "$1" = speed ] && [[ $2 =~ ^[0-9]+$ ]]; } || usage
cmd=$1
speed_lengths=${2:-"32768 131072"}
case $cmd in data|stage32k|stage128k|kill-resume|eval|speed|retrieval|all) ;; *) echo "error: unknown subcommand $cmd" >&2; usage ;; esac

cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/root/jaxcache}
py=${PYTHON:-python3}
runs=${RUNS_DIR:-/root/runs}
limit=${LIMIT_S:-540}
lr=${LR:-3e-4}
long=$runs/long
mkdir -p "$runs" "$JAX_COMPILATION_CACHE_DIR"
source scripts/_gpu_deps.sh

# The flags every stage shares: the long documents, batch 1, DENSE dense steps first (0: sparse
# from the first step).
stage_flags() {   # LENGTH STEPS [DENSE [TOPK]]
    echo --context-length "$1" --seq-len "$1" --batch-size 1 --dense-steps "${3:-0}" --steps "$2" --lr "$lr" \
        ${4:+--index-topk "$4"} \
        --warmup-steps 20 --save-every 25 --eval-every 50 --eval-batches 2 --log-every 5 \
        --data "$long/train.jsonl" --heldout-data "$long/heldout.jsonl" ${MID_FLAGS:-}
}

# train.py for at most $limit seconds (SIGTERM then: it saves and exits 0); --resume where the
# run directory has a checkpoint. Prints the run's state at the end.
train_for_a_while() {   # OUT FLAGS...
    local out=$1; shift
    local resume=()
    [ -d "$out/checkpoints" ] && resume=(--resume)
    timeout --signal=TERM --kill-after=60 "$limit" "$py" train.py "$@" --out "$out" "${resume[@]}"
    local code=$?
    if grep -q '"step"' "$out/metrics.jsonl" 2>/dev/null; then
        echo "last logged: $(tail -n 1 "$out/metrics.jsonl")"
    fi
    [ -d "$out/params" ] && grep -q "" "$out/metrics.jsonl" && echo "params/ exported"
    return $code
}

need_data() {
    [ -s "$long/train.jsonl" ] && [ -s "$long/heldout.jsonl" ] || { echo "error: run the data subcommand first" >&2; exit 2; }
    need_python_packages "$py" grain tyro || exit 2
}

case $cmd in
data)
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$py" scripts/long_documents.py --root "$site" --min-chars 50000 --out "$long/train.jsonl" \
        --heldout-packages 3 --heldout-min-chars 600000 --heldout-out "$long/heldout.jsonl" --recall-every "${RECALL_EVERY:-20000}"
    ;;
stage32k)
    need_data
    # shellcheck disable=SC2046
    train_for_a_while "$runs/mid32k" --checkpoint checkpoints/default $(stage_flags 32768 "${STEPS_32K:-300}" "${DENSE_32K:-0}" "${TOPK_32K:-}")
    ;;
stage128k)
    need_data
    [ -d "$runs/mid32k/params" ] || { echo "error: the 32K stage has no exported weights yet (run stage32k until done)" >&2; exit 2; }
    # shellcheck disable=SC2046
    train_for_a_while "$runs/mid128k" --checkpoint "$runs/mid32k" $(stage_flags 131072 "${STEPS_128K:-150}" "${DENSE_128K:-0}" "${TOPK_128K:-}")
    ;;
kill-resume)
    need_data
    base=$runs/kill-resume
    rm -rf "$base"
    # shellcheck disable=SC2046
    flags=(--checkpoint checkpoints/default $(stage_flags 32768 8) --save-every 2 --log-every 1 --eval-every 100)
    "$py" train.py "${flags[@]}" --out "$base/whole" >/dev/null || exit 1
    status=0
    for fault in step@5 saving@4; do    # killed mid-step 5; killed while checkpoint 4 is being written
        out=$base/${fault/@/-}
        GLM_JAX_FAULT=$fault "$py" train.py "${flags[@]}" --out "$out" >/dev/null
        echo "$fault: the first call ended with exit code $? (137: SIGKILL)"
        "$py" train.py "${flags[@]}" --out "$out" --resume | grep -E '^resume|^done' || status=1
        "$py" - "$base/whole/metrics.jsonl" "$out/metrics.jsonl" "$fault" <<'EOF' || status=1
import json, sys
whole, resumed = ([json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in sys.argv[1:3])
same = whole == resumed
print(f"{sys.argv[3]}: {len(resumed)} losses after the resume, bit for bit the uninterrupted run's: {same}")
sys.exit(0 if same else 1)
EOF
    done
    exit $status
    ;;
eval)
    need_data
    models=(checkpoints/default)
    for m in "$runs/mid32k" "$runs/mid128k"; do [ -d "$m/params" ] && models+=("$m"); done
    timeout 570 "$py" benchmarks/long_context_eval.py --model "${models[@]}" --heldout "$long/heldout.jsonl" \
        --length 131072 --distance 2048 16384 65536 100000 --rows 2 --probes 4 --untrained-extension \
        --json "$runs/long_context_eval.json"
    ;;
speed)
    need_data
    for length in $speed_lengths; do
        for stage in sparse dense; do
            left=$((570 - SECONDS))
            [ $left -lt 60 ] && { echo "$length $stage: skipped (no time left in this call)"; continue; }
            # a dense step at 128K takes about a minute: 3 steps, each logged (2 after compilation)
            if [ $stage = dense ]; then steps=3; dense=3; every=1; else steps=12; dense=0; every=2; fi
            out=$runs/speed-$length-$stage
            rm -rf "$out"; mkdir -p "$out"
            # shellcheck disable=SC2046
            timeout $((left < 300 ? left : 300)) "$py" train.py --checkpoint checkpoints/default $(stage_flags $length $steps) \
                --dense-steps $dense --log-every $every --eval-every 100 --save-every 100 --out "$out" > "$out.log" 2>&1
            echo "$length $stage: train.py exit code $? (124: stopped at its time limit)"
            grep -E '^compiled|^error|Error' "$out.log" | tail -n 3 | sed "s/^/$length $stage: /"
            "$py" - "$out/metrics.jsonl" "$length $stage:" <<'EOF2' || echo "$length $stage: no metrics (failed or out of memory)"
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])]
steady = [r["tokens_per_s"] for r in records if "compiled" not in r]
rate = f"{statistics.median(steady):,.0f} tokens/s (median of {len(steady)} logged intervals without compilation)" \
    if steady else "no logged interval without compilation"
print(sys.argv[2], f"{len(records)} logged, steps up to {records[-1]['step']}; {rate}; "
      f"peak memory {max(r.get('memory_gib', 0) for r in records):.1f} GiB")
EOF2
        done
    done
    ;;
retrieval)
    for spec in ${RETRIEVAL_VARIANTS:-recall2000=2000:1 recall2000-lr10=2000:10}; do
        name=${spec%%=*}; every=${spec#*=}; scale=${every#*:}; every=${every%%:*}
        [[ $name =~ ^[A-Za-z0-9_.-]+$ && $every =~ ^[0-9]+$ && $scale =~ ^[0-9.]+$ ]] || {
            echo "error: RETRIEVAL_VARIANTS takes NAME=RECALL_EVERY:INDEXER_LR_SCALE ..., got '$spec'" >&2; exit 2; }
        dir=$runs/retrieval/$name
        [ -e "$dir/done" ] && { echo "== $name: done"; cat "$dir/probe.txt"; continue; }
        left=$((${BUDGET_S:-585} - SECONDS))
        [ $left -lt 240 ] && { echo "== $name: not started ($left s left in this call; call again)"; break; }
        echo "== $name: recall pairs every $every characters, --indexer-lr-scale $scale ($left s left)"
        if [ ! -s "$dir/long/train.jsonl" ]; then
            RUNS_DIR=$dir RECALL_EVERY=$every bash "$0" data | tail -n 2 || exit 1
        fi
        if [ ! -d "$dir/mid32k/params" ]; then
            lr_flag=$([ "$scale" = 1 ] || echo "--indexer-lr-scale $scale")
            RUNS_DIR=$dir LIMIT_S=$((left - 100)) TOPK_32K=${TOPK_32K:-2048} DENSE_32K=${DENSE_32K:-100} \
                MID_FLAGS="$lr_flag ${MID_FLAGS:-}" bash "$0" stage32k > "$dir/stage32k.log" 2>&1
            grep -E '^(compiled|done|stopped|error)' "$dir/stage32k.log"
            grep -q '^error' "$dir/stage32k.log" && exit 1
            [ -d "$dir/mid32k/params" ] || { echo "== $name: the stage goes on in the next call"; break; }
        fi
        timeout 150 "$py" benchmarks/long_context_eval.py --model "$dir/mid32k" --heldout "$dir/long/heldout.jsonl" \
            --length 32768 --distance 2048 16384 --rows 1 --probes 4 --json "$dir/long_context_eval.json" \
            > "$dir/probe.log" 2>&1 || { echo "== $name: the probe failed:"; tail -n 5 "$dir/probe.log"; exit 1; }
        grep -E '^\|' "$dir/probe.log" > "$dir/probe.txt"; cat "$dir/probe.txt"
        touch "$dir/done"
    done
    ;;
all)
    # every step above in order, each once, as far as this call's time goes; call again to go on
    # (the runs, the markers of finished steps and the compilation cache stay on the machine)
    mkdir -p "$runs/done"
    left() { echo $((${BUDGET_S:-585} - SECONDS)); }
    step() {   # NAME SECONDS-NEEDED SUBCOMMAND [ARG]: once, where that much time is left
        local name=$1 need=$2; shift 2
        [ -e "$runs/done/$name" ] && return 0
        [ "$(left)" -lt "$need" ] && { echo "== $name: not started ($(left) s left in this call; call again)"; return 1; }
        echo "== $name ($(left) s left)"
        LIMIT_S=$(($(left) - 15)) timeout $(($(left) - 5)) bash "$0" "$@"
        local code=$?     # finished (passed or failed) unless cut by the time limit
        [ $code -ne 124 ] && [ $code -ne 137 ] && echo $code > "$runs/done/$name"
        echo "== $name: exit code $code"
    }
    stage() {   # SUBCOMMAND RUN: until its weights are exported; out of memory: again with --remat
        local log=$runs/$2.log
        [ -d "$runs/$2/params" ] && return 0
        [ "$(left)" -lt 150 ] && { echo "== $1: not started ($(left) s left in this call; call again)"; return 1; }
        echo "== $1 ($(left) s left)"
        LIMIT_S=$(($(left) - 45)) MID_FLAGS="$(cat "$runs/$2.flags" 2>/dev/null)" bash "$0" "$1" > "$log" 2>&1
        if grep -q -E 'RESOURCE_EXHAUSTED|Out of memory' "$log" && [ ! -e "$runs/$2.flags" ]; then
            echo "$1: out of memory; from now on with --remat"; echo --remat > "$runs/$2.flags"
            [ "$(left)" -ge 150 ] && LIMIT_S=$(($(left) - 45)) MID_FLAGS=--remat bash "$0" "$1" >> "$log" 2>&1
        fi
        grep -v -E '^step|[Ww]arning' "$log" | tail -n 8; grep -E '^step' "$log" | tail -n 3
        [ -d "$runs/$2/params" ]
    }
    step data 30 data && stage stage32k mid32k && stage stage128k mid128k && step eval 400 eval
    step kill-resume 300 kill-resume
    step speed-131072 400 speed 131072
    step speed-32768 200 speed 32768
    echo "== finished: $(cd "$runs/done" && for f in *; do printf '%s (exit %s) ' "$f" "$(cat "$f")"; done)"
    if [ -n "${COPY_TO:-}" ]; then   # the logs and metrics so far, for the docs
        mkdir -p "$COPY_TO"
        (cd "$runs" && tar czf "$COPY_TO/midtraining.tar.gz" $(ls -d ./*.log ./*/metrics.jsonl ./*/*/metrics.jsonl \
            ./long_context_eval.json 2>/dev/null)) && echo "== logs and metrics in $COPY_TO/midtraining.tar.gz"
    fi
    ;;
esac
