#!/usr/bin/env bash
# The GPU measurements that docs/training.md, docs/serving.md and docs/kernels-*.md cite as not
# measured yet, in groups; each writes its printed table (NAME.txt) and JSON under OUT_DIR.
#
#   bash scripts/gpu_benchmarks.sh OUT_DIR training kernels prefill serving
#
# training  sparse-training parts at 64K (grouped indexer KL, attention target, backward), the
#           128K sparse step's memory plan, sparse against dense train steps at 64K and 128K
# kernels   the paged decode kernels (sparse MLA, indexer top-k) against the gather path and the
#           copy bandwidth
# prefill   one 200K-token prompt, IndexShare against all Full
# serving   host time per engine step; the load benchmark (continuous engine against static
#           waves, IndexShare against all Full, contexts up to 1M)
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,14p' "$0"
    exit 2
fi
out=$1
shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=.
py=${PYTHON:-python3}

run() {
    local name=$1
    shift
    echo "== $name: $py $*"
    "$py" "$@" 2>&1 | tee "$out/$name.txt"
}

for group in "$@"; do
    case $group in
        training)
            run sparse_train_parts_64k benchmarks/sparse_train_parts.py --seq-len 65536 \
                --json "$out/sparse_train_parts_64k.json"
            run train_memory_128k benchmarks/train_memory.py --seq-len 131072 --stages sparse
            run train_long_64k benchmarks/train_long.py --seq-len 65536 --stages sparse dense \
                --sparse-impls pallas_gpu --json "$out/train_long_64k.json"
            run train_long_128k benchmarks/train_long.py --seq-len 131072 --stages sparse dense \
                --sparse-impls pallas_gpu --json "$out/train_long_128k.json"
            ;;
        kernels)
            run sparse_mla_paged benchmarks/sparse_mla.py --paged-only --json "$out/sparse_mla_paged.json"
            run indexer_topk_paged benchmarks/indexer_topk.py --paged-only --json "$out/indexer_topk_paged.json"
            ;;
        prefill)
            run long_prefill_200k benchmarks/long_context.py --prefill 200000 --json "$out/long_prefill_200k.json"
            ;;
        serving)
            run engine_steps benchmarks/engine_steps.py --config configs/small-128k.yaml --max-context 16384 \
                --new-tokens 12000
            run serving_load benchmarks/serving_load.py --out "$out/serving_load.json"
            ;;
        *)
            echo "unknown group '$group' (training, kernels, prefill, serving)" >&2
            exit 2
            ;;
    esac
done
