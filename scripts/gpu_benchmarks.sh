#!/usr/bin/env bash
# The GPU measurements that docs/training.md, docs/serving.md and docs/kernels-*.md cite as not
# measured yet, in groups sized for one command of at most 9.5 minutes each.
#
#   bash scripts/gpu_benchmarks.sh [--smoke] [--budget SECONDS] OUT_DIR GROUP...
#
# GROUP          what it measures                                          estimate on one H200
# training-parts  sparse-training parts at 64K (top-k, sparse MLA forward     6-9 min
#                 and backward; then the indexer KL, new parts first, the old
#                 per-layer KL last), each under its own limit
# training-memory the 128K sparse step's memory plan (compiled, not run)     1-4 min
# training-64k    a sparse train step at 64K tokens (layers rematerialised     4-7 min
#                 whole, then with --keep-attention) and a dense one
# training-128k   the same at 128K (the sparse step may not fit: reported)    4-7 min
# training-glm52-64k  GLM-5.2's attention shape (configs/glm-5.2-attn.yaml,     5-9 min
#                 4 layers): the 128K memory plan, a sparse and a dense
#                 train step at 64K
# training-glm52-128k  the same steps at 128K                                  6-9 min
# training-glm52-tuned  the sparse MLA forward's settings swept at 64 heads      4-6 min
#                 (16K queries over 64K keys), then the 64K sparse and dense
#                 steps at GLM-5.2's attention shape with the fastest
# training-glm52-profile  the 64K sparse step at GLM-5.2's attention shape,    3-5 min
#                 then one more traced (command buffers off): its GPU time by
#                 part and by kernel
# serving-itl     host time per engine step (16K context), then the load      5-7 min
#                 benchmark at 32K with a step token budget of 200: ITL p99
#                 against p50 at 80% of saturation
# kernels         paged sparse MLA decode (Triton and Mosaic GPU) and paged   4-6 min
#                 indexer top-k decode against the gather path, beside the
#                 copy bandwidth; the prefill forward at 64 heads (16K
#                 queries over 64K keys), Triton against Mosaic GPU
# fp8             paged decode over FP8 against bf16 cache pages: sparse MLA  2-5 min
#                 at 128K and 1M (batch 64, 128), the indexer top-k at 1M
# fp8-serving     the engine under load at 128K, small-128k, bf16 then FP8    5-9 min
#                 pools of the same bytes (0.2 of the free memory): sequences
#                 admitted, decode tokens/s, TTFT, ITL and their FP8 / bf16
#                 ratios, 20 requests of 128K tokens at 1/s and 100/s
# fp8-quality     held-out bits per byte, FP8 against bf16 cache: the default  3-6 min
#                 model at 4K, small-128k (random weights) at 32K; greedy
#                 agreement on 32 held-out prompts, plain and K = 7 (the
#                 held-out corpus built first unless runs/pycorpus is there)
# prefill         one 200K-token prompt, IndexShare against all Full          2-4 min
# serving         host time per engine step (16K context, 12,000 tokens);    6-8 min
#                 the load benchmark at 32K, IndexShare: a rate sweep to
#                 saturation, the device ceiling, 80% of saturation, with
#                 and without step token budgets of 264 and 520
# host            host time per decode step with and without CUDA graphs,    6-8 min
#                 small-128k and serving_load.py's model (16K, 3,000 tokens),
#                 then with blocks of 8 decode steps per call
# serving-128k    the same load benchmark at 128K                             6-9 min
# layer-split     on two GPUs: LayerSplit decode (layer=2) against one GPU    4-8 min
#                 at 128K and 256K, tokens compared; layer-split-1m: at 1M,
#                 the split run traced (profile/)                              6-10 min
# layer-split-serving  on two GPUs: the load benchmark at 128K, cache split    5-9 min
#                 by layers (against serving-128k's one-GPU rows)
# serving-full    the load benchmark at 32K with every layer Full             5-8 min
# serving-1m      the load benchmark at 1M, IndexShare only                   4-10 min
# serving-1m-full the same with every layer Full                              6-18 min
# train-parts    the default recipe's train-step parts (vocabulary head,     4-7 min
#                 embedding, MoE, dense-stage KL; sparse MLA at 8 heads per
#                 backward mode) old against new, beside their limits
# dense-kl-long  the dense-stage indexer KL of one default-model group alone,   3-6 min
#                 forward and backward at 32K and 128K tokens, XLA against
#                 the Pallas kernels (lab/dense_indexer_kl_gpu.py, outside the
#                 package), beside the op's matmul limit
# dense-step-128k  train.py's dense warm-up step of the default model at 128K  4-7 min
#                 (benchmarks/train_long.py): the attention alone, then with
#                 the XLA indexer KL; each traced, its kernel table printed
# sparse-mla-cuda  the CUDA sparse MLA (scripts/build_cuda_kernels.sh first;   4-6 min
#                 carry build/cuda): checks against the float64 oracle, bitwise
#                 repeats, gradients, timings against pallas_gpu beside the
#                 matmul rate and copy bandwidth; memcheck and racecheck runs
# train-steps    the recipe's step alone, absorbed form, dense and sparse,    6-8 min
#                 then the dense step with the lab's Pallas dense-stage KL; each
#                 traced (kernel table in profile/)
# train-steps-trained  the step alone from checkpoints/default's weights,     3-4 min
#                 dense segment bound 32 (the loop's conditions late in a run)
# train-steps-expanded  the same in the expanded form (the old default)      3-5 min
# train-loop     the step alone, then train.py on the recipe's shape (30      8-9 min
#                 dense, 40 sparse steps) with 2 batches packed ahead
# mtp-ablation   the published MTP ablation on checkpoints/default (its MTP    5-8 min
#                 layer fine-tuned 3 ways, backbone frozen; 64 held-out
#                 prompts of its corpus, built first unless runs/pycorpus is
#                 there: about 1-2 min)
# speculative    the batch-invariance checks (tests/test_batch_invariant.py   8-9 min
#                 on the GPU), then plain vs speculative decoding of
#                 checkpoints/default at batch 1 and 8, K = 1, 3, 7, greedy,
#                 the default and the batch-invariant mode (rows that differ
#                 from each prompt alone; fails if the invariant mode differs)
# speculative-32  the same at batch 32, greedy and temperature 0.7           7-9 min
# speculative-graphs  batch 1 and 32 greedy with the generators' programs as   6-9 min
#                 CUDA graphs (loops included): what the host's launches cost
#                 plain and speculative decoding, and the batch-invariant
#                 mode's chunked verify steps
# speculative-rows  the batch-invariant mode in chunks of 64 against 128      7-9 min
#                 tokens, CUDA graphs on, batch 1, 8 and 32 greedy, K = 3, 7
# speculative-sampled  batch 1 and 8 at temperature 0.7                      6-9 min
# speculative-context  acceptance by prompt length (1K and 3K tokens), K = 7   2-4 min
# Aliases (several commands' time: run their groups one command at a time):
# training = training-parts training-memory training-64k training-128k;
# serving-all = serving serving-128k serving-full serving-1m serving-1m-full.
# The estimates are not measurements; docs/training.md ("Running the pending GPU
# measurements") says how each was derived.
#
# Each benchmark runs under `timeout` (its own limit, and never past --budget, default 560 s
# from the start, so the command ends inside a 10-minute limit); a benchmark that fails or
# times out is reported and the next one runs. Its printed table (NAME.txt) and JSON go to
# runs/gpu_benchmarks/ARCHIVE/, and after every benchmark they are packed into
# OUT_DIR/ARCHIVE.tar.gz (ARCHIVE: gpu_benchmarks-GROUPS), with summary.txt (status and seconds
# of each) and environment.txt (device, versions). Exit status 1 if any benchmark failed,
# timed out or was skipped for lack of time. --smoke runs every benchmark of the groups at tiny
# sizes on the CPU (each one's --smoke or small flags; no budget unless given).
# PYTHON (default python3) is the interpreter; RUNS_DIR (default runs) holds the work.
set -uo pipefail

usage() {
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 2
}

smoke=0
budget=""
while [ $# -gt 0 ]; do
    case $1 in
        --smoke) smoke=1; shift ;;
        --budget)
            [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "--budget needs a number of seconds" >&2; exit 2; }
            budget=$2; shift 2 ;;
        -h|--help) usage ;;
        -*) echo "unknown option '$1'" >&2; usage ;;
        *) break ;;
    esac
done
[ $# -ge 2 ] || usage
out=$1
shift

expand() {
    case $1 in
        training) echo training-parts training-memory training-64k training-128k ;;
        serving-all) echo serving serving-128k serving-full serving-1m serving-1m-full ;;
        dense-kl-long|dense-step-128k|sparse-mla-cuda|train-parts|train-steps|train-steps-trained|train-steps-expanded|train-loop) echo "$1" ;;
        mtp-ablation|speculative|speculative-32|speculative-graphs|speculative-rows|speculative-sampled|speculative-context) echo "$1" ;;
        training-parts|serving-itl|training-glm52-profile|training-glm52-tuned|training-memory|training-64k|training-128k|training-glm52-64k|training-glm52-128k|kernels|fp8|fp8-serving|fp8-quality|prefill|serving|host|layer-split|layer-split-1m|layer-split-serving|serving-128k|serving-full|serving-1m|serving-1m-full)
            echo "$1" ;;
        *) return 1 ;;
    esac
}
groups=()
for g in "$@"; do
    names=$(expand "$g") || { echo "unknown group '$g' (see --help)" >&2; exit 2; }
    groups+=($names)
done

cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ $smoke = 1 ]; then
    export JAX_PLATFORMS=cpu
    suffix=-smoke
else
    export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}     # fail, rather than measure a CPU, without a GPU
    suffix=""
    budget=${budget:-560}
fi
archive=gpu_benchmarks-$(IFS=_; echo "${groups[*]}")$suffix
stage=${RUNS_DIR:-runs}/gpu_benchmarks/$archive
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -rf "$stage"
mkdir -p "$stage"
start=$SECONDS
reserve=10              # seconds kept back for packing the archive
failures=0
pack() {
    tar -czf "$out/$archive.tar.gz.tmp" -C "$(dirname "$stage")" "$archive" && \
        mv "$out/$archive.tar.gz.tmp" "$out/$archive.tar.gz"
}
note() {
    printf '%-28s %-22s %5d s\n' "$1" "$2" "$3" | tee -a "$stage/summary.txt"
}

# run NAME LIMIT_S SMOKE_ARGS CMD...: CMD (with SMOKE_ARGS appended under --smoke; argparse
# keeps the last value of a repeated flag) under timeout, its output in NAME.txt.
run() {
    local name=$1 limit=$2 smoke_args=$3
    shift 3
    local cmd=("$@")
    [ $smoke = 1 ] && cmd+=($smoke_args)
    if [ -n "$budget" ] && [ "$budget" != 0 ]; then
        local left=$((budget - (SECONDS - start) - reserve))
        [ $left -lt $limit ] && limit=$left
    fi
    if [ $limit -lt 1 ]; then
        note "$name" "skipped (no time left)" 0
        failures=$((failures + 1))
        return
    fi
    echo "== $name (limit ${limit}s): ${cmd[*]}"
    local t=$SECONDS
    timeout --signal=TERM --kill-after=15 "$limit" "${cmd[@]}" 2>&1 | tee "$stage/$name.txt"
    local status=${PIPESTATUS[0]}
    if [ "$status" = 0 ]; then
        note "$name" ok $((SECONDS - t))
    elif [ "$status" = 124 ] || [ "$status" = 137 ]; then
        note "$name" "timed out" $((SECONDS - t))
        failures=$((failures + 1))
    else
        note "$name" "failed (exit $status)" $((SECONDS - t))
        failures=$((failures + 1))
    fi
    pack
}

{
    echo "date: $(date -u +%FT%TZ)"
    echo "groups: ${groups[*]}; smoke: $smoke; budget: ${budget:-none} s"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no .git)')"
    echo "host: $(uname -srm); $(nproc) cores"
    timeout 120 "$py" -c 'import sys, jax; print("python", sys.version.split()[0], "jax", jax.__version__,
                                                 "devices", jax.devices())' 2>&1 | tail -3
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} > "$stage/environment.txt"
: > "$stage/summary.txt"
mem95=(env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95)   # the training steps need the card's memory
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(cd "${RUNS_DIR:-runs}" && pwd)/jax_cache}
parts=benchmarks/train_step_parts.py
# the train-* groups read real packed batches through grain, fp8-quality tokenizes as the data
# pipeline does, and the benchmarks that run train.py or decode.py parse their flags with tyro
source scripts/_gpu_deps.sh
[ $smoke = 1 ] || need_python_packages "$py" grain tyro || echo "the groups that need them will fail" >&2
for group in "${groups[@]}"; do
    case $group in
        train-parts)
            run train_step_parts 300 "--smoke" "${mem95[@]}" "$py" $parts parts --json "$stage/parts.json"
            run sparse_mla_default_py 180 "--smoke" "$py" benchmarks/sparse_mla_backward.py --shape default-py \
                --json "$stage/sparse_mla_default_py.json"
            ;;
        dense-kl-long)
            run dense_kl_32k 150 "--smoke" "$py" benchmarks/dense_kl_long.py --seq-len 32768 --impls xla pallas_gpu \
                --json "$stage/dense_kl_32k.json"
            run dense_kl_128k 300 "--smoke" "$py" benchmarks/dense_kl_long.py --seq-len 131072 --impls pallas_gpu xla \
                --reps 2 --json "$stage/dense_kl_128k.json"
            ;;
        dense-step-128k)
            # the traces (hundreds of MB) stay outside the archive; the kernel tables are in the log
            run train_long_dense_128k 480 "--smoke" "${mem95[@]}" env XLA_FLAGS=--xla_gpu_enable_command_buffer= \
                "$py" benchmarks/train_long.py --config configs/default-py.yaml --seq-len 131072 --stages dense \
                --dense-kl none xla --steps 1 --profile "$(dirname "$stage")/traces-dense-128k" \
                --json "$stage/train_long_dense_128k.json"
            ;;
        sparse-mla-cuda)
            run sparse_mla_cuda 300 "--smoke" "$py" benchmarks/sparse_mla_cuda.py --json "$stage/sparse_mla_cuda.json"
            if [ $smoke = 0 ]; then     # compute-sanitizer: CUDA's memory and shared-memory race checks
                run cuda_memcheck 150 "" env XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
                    "$py" benchmarks/sparse_mla_cuda.py --sanitize
                run cuda_racecheck 150 "" compute-sanitizer --tool racecheck "$py" benchmarks/sparse_mla_cuda.py --sanitize
            fi
            ;;
        train-steps)
            run train_steps 330 "--smoke --reps 1" "${mem95[@]}" "$py" $parts steps \
                --variants dense:absorbed sparse:absorbed --json "$stage/steps.json" --profile "$stage/profile"
            run train_steps_pallas_kl 200 "--smoke --reps 1" "${mem95[@]}" "$py" $parts steps \
                --variants dense:absorbed --dense-kl pallas_gpu --json "$stage/steps-pallas-kl.json" \
                --profile "$stage/profile"
            ;;
        train-steps-trained)
            # the step from the trained default model (its indexer's selections, as late in a run)
            # and with a larger dense segment bound, as train.py reaches on packages' many small files
            run train_steps_trained 200 "--smoke --reps 1" "${mem95[@]}" "$py" $parts steps \
                --variants dense:absorbed sparse:absorbed --params checkpoints/default --max-segments 32 \
                --json "$stage/steps-trained.json"
            ;;
        train-steps-expanded)
            run train_steps_expanded 540 "--smoke --reps 1" "${mem95[@]}" "$py" $parts steps \
                --variants dense:expanded sparse:expanded --json "$stage/steps-expanded.json"
            ;;
        train-loop)
            # the step alone and train.py's loop on the same shape in one command, the loop with 2
            # batches packed ahead (each compile takes about 75 s on a fresh machine)
            run train_steps_alone 240 "--smoke --reps 1" "${mem95[@]}" "$py" $parts steps \
                --variants dense:absorbed sparse:absorbed --json "$stage/steps.json"
            run train_loop 300 "--smoke --loop-dense 2 --loop-sparse 3 --log-every 1" "${mem95[@]}" "$py" $parts \
                loop --loop-dense 30 --loop-sparse 40 --log-every 5 --prefetch-batches 2 --json "$stage/loop.json" \
                --run-dir "${RUNS_DIR:-runs}/loop-bench"
            ;;
        mtp-ablation)
            corpus="${RUNS_DIR:-runs}/pycorpus"
            if [ $smoke = 0 ] && [ ! -f "$corpus/manifest.json" ]; then
                run python_corpus 240 "" "$py" scripts/build_python_corpus.py --out "$corpus"
            fi
            if [ $smoke = 1 ]; then corpus_flags=(); else
                corpus_flags=(--heldout "$corpus/heldout.jsonl" --train-data "$corpus/train.jsonl"); fi
            run mtp_ablation 480 "--smoke" "$py" benchmarks/mtp_ablation.py --checkpoint checkpoints/default \
                "${corpus_flags[@]}" --prompts 64 --prompt-len 256 --new-tokens 128 --finetune-steps 400 \
                --train-depth 7 --seq-len 1024 --batch-size 16 --json "$stage/mtp_ablation.json"
            ;;
        speculative)
            run batch_invariance_checks 180 "-k in_row_chunks" "$py" -m pytest -x -q -p no:cacheprovider \
                tests/test_batch_invariant.py
            run speculative_t0 370 "--batch 1 2 --draft 1 3 --new-tokens 8 --repeat 1" "$py" benchmarks/speculative.py \
                --batch 1 8 --draft 1 3 7 --new-tokens 128 --repeat 2 --batch-invariant \
                --json "$stage/speculative_t0.json"
            ;;
        speculative-32)
            for t in 0 0.7; do
                run speculative_b32_t$t 270 "--batch 2 --draft 1 3 --new-tokens 8 --repeat 1" "$py" \
                    benchmarks/speculative.py --batch 32 --draft 1 3 7 --new-tokens 128 --repeat 2 --temperature $t \
                    --batch-invariant --json "$stage/speculative_b32_t$t.json"
            done
            ;;
        speculative-graphs)
            # plain and speculative decoding with the generators' programs as CUDA graphs (loops
            # included), batch 1 and 32 greedy; compare with speculative and speculative-32's rows
            run speculative_graphs 540 "--batch 1 2 --draft 1 3 --new-tokens 8 --repeat 1" "$py" \
                benchmarks/speculative.py --batch 1 32 --draft 3 7 --new-tokens 128 --repeat 2 --batch-invariant \
                --cuda-graphs --json "$stage/speculative_graphs.json"
            ;;
        speculative-rows)
            # the batch-invariant mode's chunk size: 64 tokens (the GPU's default) against 128, where
            # a verify step of 32 sequences x 4 tokens is one chunk; CUDA graphs on, batch 1, 8 and 32
            run speculative_rows 540 "--batch 1 2 --draft 1 3 --new-tokens 8 --repeat 1" "$py" \
                benchmarks/speculative.py --batch 1 8 32 --draft 3 7 --new-tokens 128 --repeat 2 --batch-invariant \
                --invariant-rows 64 128 --cuda-graphs --json "$stage/speculative_rows.json"
            ;;
        speculative-sampled)
            run speculative_t07 540 "--batch 1 2 --draft 1 3 --new-tokens 8 --repeat 1" "$py" benchmarks/speculative.py \
                --batch 1 8 --draft 1 3 7 --new-tokens 128 --repeat 2 --temperature 0.7 --batch-invariant \
                --json "$stage/speculative_t07.json"
            ;;
        speculative-context)
            for len in 1024 3072; do
                run speculative_prompt_$len 120 "--prompt-len 128 --new-tokens 8" "$py" benchmarks/speculative.py \
                    --batch 1 --draft 7 --prompt-len $len --new-tokens 128 --repeat 2 \
                    --json "$stage/speculative_prompt_$len.json"
            done
            ;;
        training-parts)
            run sparse_train_parts_64k 150 "--seq-len 128 --smoke" "$py" benchmarks/sparse_train_parts.py \
                --seq-len 65536 --impls pallas_gpu --only attention --json "$stage/sparse_train_parts_64k.json"
            run sparse_train_kl_64k 390 "--seq-len 128 --smoke" "$py" benchmarks/sparse_train_parts.py \
                --seq-len 65536 --only kl --json "$stage/sparse_train_kl_64k.json"
            ;;
        serving-itl)
            run engine_steps 120 "--config configs/tiny.yaml --max-context 256 --new-tokens 64" \
                "$py" benchmarks/engine_steps.py --config configs/small-128k.yaml --max-context 16384 --new-tokens 6000
            run serving_load_32k_budget_200 420 "--smoke --contexts 256" "$py" benchmarks/serving_load.py \
                --contexts 32768 --sweep --max-rates 3 --patterns IndexShare --step-token-budget 200 \
                --out "$stage/serving_load_32k_budget_200.json"
            ;;
        training-memory)
            run train_memory_128k 240 "--config configs/tiny.yaml --seq-len 256" "${mem95[@]}" "$py" \
                benchmarks/train_memory.py --seq-len 131072 --stages sparse
            ;;
        training-64k)
            run train_long_64k 540 "--smoke" "${mem95[@]}" "$py" benchmarks/train_long.py --seq-len 65536 \
                --stages sparse dense --sparse-impls pallas_gpu --keep-attention --json "$stage/train_long_64k.json"
            ;;
        training-glm52-64k)
            # GLM-5.2's attention at full size on 4 layers (configs/glm-5.2-attn.yaml): the memory
            # plan of the 128K steps first (compiled, not run), then a sparse and a dense step at 64K
            run train_memory_glm52_128k 150 "--config configs/tiny.yaml --seq-len 256" "${mem95[@]}" "$py" \
                benchmarks/train_memory.py --config configs/glm-5.2-attn.yaml --seq-len 131072 --stages sparse dense
            run train_long_glm52_64k 400 "--smoke" "${mem95[@]}" "$py" benchmarks/train_long.py \
                --config configs/glm-5.2-attn.yaml --seq-len 65536 --stages sparse dense --sparse-impls pallas_gpu \
                --json "$stage/train_long_glm52_64k.json"
            # the CUDA kernels' train step (the wgmma forward and its indexer target; needs build/cuda)
            if [ -f build/cuda/libglm_sparse_mla.so ]; then
                run train_long_glm52_64k_cuda 300 "--smoke" "${mem95[@]}" "$py" benchmarks/train_long.py \
                    --config configs/glm-5.2-attn.yaml --seq-len 65536 --stages sparse --sparse-impls cuda-wgmma \
                    --json "$stage/train_long_glm52_64k_cuda.json"
            fi
            ;;
        training-glm52-tuned)
            run sparse_mla_fwd_sweep_64h 200 "--smoke" "$py" benchmarks/sparse_mla_fwd_sweep.py --heads 64 \
                --queries 16384 --context 65536 --head-group 0 32 --best "$stage/sparse_mla_fwd_best.json"
            best=$([ -f "$stage/sparse_mla_fwd_best.json" ] && cat "$stage/sparse_mla_fwd_best.json" || echo "{}")
            run train_long_glm52_64k_tuned 330 "--smoke" "${mem95[@]}" "$py" benchmarks/train_long.py \
                --config configs/glm-5.2-attn.yaml --seq-len 65536 --stages sparse dense --sparse-impls pallas_gpu \
                --sparse-config "$best" --json "$stage/train_long_glm52_64k_tuned.json"
            ;;
        training-glm52-profile)
            run train_long_glm52_64k_profile 330 "--smoke" "${mem95[@]}" XLA_FLAGS=--xla_gpu_enable_command_buffer= \
                "$py" benchmarks/train_long.py --config configs/glm-5.2-attn.yaml --seq-len 65536 --stages sparse \
                --sparse-impls pallas_gpu --steps 1 --profile "${RUNS_DIR:-runs}/glm52_profile" \
                --json "$stage/train_long_glm52_64k_profile.json"
            ;;
        training-glm52-128k)
            run train_long_glm52_128k 540 "--smoke" "${mem95[@]}" "$py" benchmarks/train_long.py \
                --config configs/glm-5.2-attn.yaml --seq-len 131072 --stages sparse dense --sparse-impls pallas_gpu \
                --json "$stage/train_long_glm52_128k.json"
            ;;
        training-128k)
            run train_long_128k 540 "--smoke" "${mem95[@]}" "$py" benchmarks/train_long.py --seq-len 131072 \
                --stages sparse dense --sparse-impls pallas_gpu --keep-attention --json "$stage/train_long_128k.json"
            ;;
        kernels)
            run sparse_mla_paged 240 "--smoke" "$py" benchmarks/sparse_mla.py --paged-only \
                --json "$stage/sparse_mla_paged.json"
            run sparse_mla_prefill_mosaic 240 "--smoke" "$py" benchmarks/sparse_mla.py --mosaic-prefill \
                --prefill-queries 16384 --prefill-context 65536 --json "$stage/sparse_mla_prefill_mosaic.json"
            run indexer_topk_paged 240 "--smoke" "$py" benchmarks/indexer_topk.py --paged-only \
                --json "$stage/indexer_topk_paged.json"
            ;;
        fp8)
            run fp8_decode 420 "--smoke" "$py" benchmarks/fp8_decode.py --json "$stage/fp8_decode.json"
            ;;
        fp8-serving)
            # every request at the full 128K (prompt 129,920 + 1,152 new tokens); 20 slots, more than
            # either pool admits, so the pool's pages bound the sequences decoding together
            tiny="--smoke --contexts 256 --requests 4 --new-tokens 8 --min-prompt 16 --slots 4 --kv-cache-memory-bytes 2000000"
            run serving_load_128k_fp8 540 "$tiny" "$py" benchmarks/serving_load.py --config configs/small-128k.yaml \
                --contexts 131072 --patterns IndexShare --kv-cache-dtype auto fp8 --cache-memory-fraction 0.2 \
                --slots 20 --requests 20 --new-tokens 1152 --min-prompt 129920 --rates 1 100 --ceiling-points 0 \
                --no-waves --out "$stage/serving_load_128k_fp8.json"
            ;;
        fp8-quality)
            run fp8_bits_per_byte_4k 150 "--smoke --context 128 --rows 2" "$py" benchmarks/fp8_bits_per_byte.py \
                --context 4096 --rows 16 --json "$stage/fp8_bits_per_byte_4k.json"
            run fp8_bits_per_byte_32k 200 "--smoke --context 128 --rows 2" "$py" benchmarks/fp8_bits_per_byte.py \
                --config configs/small-128k.yaml --context 32768 --rows 4 --json "$stage/fp8_bits_per_byte_32k.json"
            corpus="${RUNS_DIR:-runs}/pycorpus"
            if [ $smoke = 0 ] && [ ! -f "$corpus/manifest.json" ]; then
                run python_corpus 240 "" "$py" scripts/build_python_corpus.py --out "$corpus"
            fi
            # the stdlib split has 31 documents: 32 prompts come from the corpus's held-out packages
            if [ $smoke = 1 ]; then heldout_flags=(); else heldout_flags=(--heldout "$corpus/heldout.jsonl"); fi
            for k in 0 7; do
                run fp8_agreement_k$k 150 "--prompts 2 --prompt-len 32 --new-tokens 8" "$py" \
                    benchmarks/fp8_agreement.py "${heldout_flags[@]}" --prompts 32 --new-tokens 128 --speculative $k \
                    --json "$stage/fp8_agreement_k$k.json"
            done
            ;;
        prefill)
            run long_prefill_200k 420 "--smoke --prefill 512 --prefill-chunk 128" "$py" benchmarks/long_context.py \
                --prefill 200000 --json "$stage/long_prefill_200k.json"
            ;;
        serving)
            run engine_steps 180 "--config configs/tiny.yaml --max-context 256 --new-tokens 64 --check-cuda-graphs 8" \
                "$py" benchmarks/engine_steps.py --config configs/small-128k.yaml --max-context 16384 \
                --new-tokens 12000 --check-cuda-graphs 256
            run serving_load_32k 480 "--smoke --contexts 256" "$py" benchmarks/serving_load.py --contexts 32768 --sweep \
                --max-rates 4 --patterns IndexShare --step-token-budget 264 520 --out "$stage/serving_load_32k.json"
            ;;
        host)
            for model in configs/small-128k.yaml serving-load; do
                name=$(basename "$model" .yaml)
                for graphs in "" --no-cuda-graphs; do
                    run "engine_steps_${name}${graphs:+_no_graphs}" 120 \
                        "--config configs/tiny.yaml --max-context 256 --new-tokens 64 $graphs" "$py" \
                        benchmarks/engine_steps.py --config "$model" --max-context 16384 --new-tokens 3000 $graphs
                done
                run "engine_steps_${name}_blocks8" 150 \
                    "--config configs/tiny.yaml --max-context 256 --new-tokens 64 --decode-steps 8" "$py" \
                    benchmarks/engine_steps.py --config "$model" --max-context 16384 --new-tokens 3000 --decode-steps 8 \
                    --check-cuda-graphs 256
            done
            ;;
        layer-split)
            # two GPUs (a two-GPU machine): LayerSplit decode against one GPU, tokens compared
            run layer_split_decode 540 "--smoke" "$py" benchmarks/layer_split_decode.py --contexts 131072 262144 \
                --json "$stage/layer_split_decode.json"
            ;;
        layer-split-1m)
            run layer_split_decode_1m 540 "--smoke" "$py" benchmarks/layer_split_decode.py --contexts 1048576 \
                --profile "$stage/profile" --json "$stage/layer_split_decode_1m.json"
            ;;
        layer-split-serving)
            # two GPUs: the load benchmark at 128K with the cache split by layers (one GPU: serving-128k)
            run serving_load_128k_split 540 "--smoke --contexts 256" "$py" benchmarks/serving_load.py \
                --contexts 131072 --sweep --max-rates 2 --patterns IndexShare --mesh layer=2 \
                --out "$stage/serving_load_128k_split.json"
            ;;
        serving-128k)
            run serving_load_128k 540 "--smoke --contexts 256" "$py" benchmarks/serving_load.py --contexts 131072 --sweep \
                --max-rates 3 --patterns IndexShare --step-token-budget 520 --out "$stage/serving_load_128k.json"
            ;;
        serving-full)
            run serving_load_32k_full 540 "--smoke --contexts 256" "$py" benchmarks/serving_load.py --contexts 32768 \
                --sweep --max-rates 4 --patterns "all Full" --out "$stage/serving_load_32k_full.json"
            ;;
        serving-1m)
            run serving_load_1m 540 "--smoke --contexts 256" "$py" benchmarks/serving_load.py --contexts 1048576 \
                --patterns IndexShare --out "$stage/serving_load_1m.json"
            ;;
        serving-1m-full)
            run serving_load_1m_full 540 "--smoke --contexts 256" "$py" benchmarks/serving_load.py \
                --contexts 1048576 --patterns "all Full" --out "$stage/serving_load_1m_full.json"
            ;;
    esac
done
[ -f "$stage/steps.json" ] || [ -f "$stage/parts.json" ] || [ -f "$stage/loop.json" ] && \
    "$py" $parts table "$stage" --markdown "$stage/train_step_table.md" > /dev/null 2>&1
pack
echo
echo "summary ($((SECONDS - start)) s; archive $out/$archive.tar.gz):"
cat "$stage/summary.txt"
if [ $failures -gt 0 ]; then
    echo "$failures benchmark(s) failed, timed out or were skipped" >&2
    exit 1
fi
