"""Train a GLM-5.2-style model on the Python standard library's source (or resume a run).

    python train.py --config configs/tiny.yaml --out runs/tiny --steps 600
    python train.py --init-from-hf GLM-5.2/ --out runs/glm --steps 100   # fine-tune published weights
    python train.py --mesh data=16 --out /shared/runs/tiny --coordinator 10.0.0.1:1234 --num-processes 2 \
        --process-id 0                          # one of several processes (hosts), each reading its data shard

The run directory receives tokenizer.json (a byte-level BPE trained on the training files),
config.yaml, checkpoints/ (orbax: params, optimizer state, data position) every --save-every
steps, params/ (the final weights, what decode.py loads) and metrics.jsonl. Several processes
share it: process 0 writes the files, all of them write and read the checkpoints together.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from glm_jax import costs, multihost, ops, sharding
from glm_jax.checkpoint import check_same_config, save_model_dir
from glm_jax.config import ConfigError, load_config, save_config
from glm_jax.data import batches as data_batches
from glm_jax.data import corpus, pipeline, sources, tokenizer as tok_lib
from glm_jax.info import params_by_part
from glm_jax.layers.segments import count_segments, segment_bound
from glm_jax.model import GLMModel, abstract_model, count_params
from glm_jax.multihost_flags import add_distributed_flags
from glm_jax.training import checkpointing
from glm_jax.training.step import (EXPANDED_MAX_LEN, LossWeights, attention_form, eval_step, make_optimizer,
                                   train_step)

TOKENIZER_DOCS = 20_000  # documents the tokenizer is trained on (and the most held-out ones encoded)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None,
                    help="configs/*.yaml or a config.json (default: configs/tiny.yaml, or the --init-from-hf config)")
    ap.add_argument("--init-from-hf", default=None, metavar="DIR",
                    help="start from the weights (and tokenizer.json, if any) of a Hugging Face checkpoint")
    ap.add_argument("--out", required=True, help="run directory (created; reused with --resume)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--dense-steps", type=int, default=100,
                    help="steps of dense attention (indexer warm-up) before sparse attention")
    ap.add_argument("--indexer-weight", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--mtp-depth", type=int, default=1, help="MTP applications per position (shared weights)")
    ap.add_argument("--tv-weight", type=float, default=0.0, help="end-to-end total-variation loss weight")
    ap.add_argument("--no-mtp-kv-share", action="store_true",
                    help="MTP depths >= 2 compute their own KV and indices instead of reusing depth 1's")
    ap.add_argument("--log-every", type=int, default=10, help="print and record metrics every N steps")
    ap.add_argument("--metrics-file", default=None, help="JSON lines, one per logged step (default OUT/metrics.jsonl)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's peak bf16 TFLOP/s, for MFU (default: known accelerators, else none)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--data", nargs="+", default=None, metavar="PATH",
                    help="training text: .txt (a file is a document), .jsonl ({\"text\": ...} per line), "
                         ".array_record files or directories of them (default: the Python standard library)")
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N training documents")
    ap.add_argument("--data-shards", type=int, default=None, metavar="N",
                    help="build each batch from N data shards (shard i packs documents i, i+N, ...), each "
                         "process reading those of its rows (default: one per process); a run with the same "
                         "N sees the same batches whatever its number of processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export-dtype", default=None, help="cast the exported params/ (e.g. bfloat16)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    ap.add_argument("--stop-after", type=int, default=None, metavar="N",
                    help="run at most N steps in this invocation, save and exit (for time-limited jobs)")
    ap.add_argument("--remat", action="store_true", help="recompute activations in the backward pass")
    ap.add_argument("--mesh", default=None, metavar="SPEC",
                    help="shard the run over a device mesh, e.g. data=8 or data=2,tensor=2,layer=2: batch "
                         "and (FSDP) the model dimension of the weights over data, the sequence over context "
                         "(context parallelism, e.g. data=2,context=4), heads / FFN / experts over tensor "
                         "(and layer); on a CPU the devices are simulated")
    ap.add_argument("--attention-form", default="auto", choices=["auto", "expanded", "absorbed"],
                    help="expanded: [S, S] attention matrices, every loss (short sequences); absorbed: none, "
                         "for long sequences (the dense stage then cannot train the indexer); auto: "
                         f"expanded up to {EXPANDED_MAX_LEN} tokens")
    ap.add_argument("--attention-impl", default="auto", choices=ops.impl_choices("sparse_mla"),
                    help="sparse attention kernel; auto: the backend's Pallas kernel, except on a TPU the "
                         "chunked xla one for absorbed-form training of sequences over 8192 tokens (the TPU "
                         "kernel's backward keeps one 576-wide row per query and selected key)")
    add_distributed_flags(ap, "the run directory's files (the checkpoints are written together)")
    return ap.parse_args(argv)


def prepare_data(args, cfg, out: Path, documents=None):
    """Tokenizer (trained once, then reused), the training documents and the held-out tokens.

    documents: the --data source (default: the standard library's files, split by file)."""
    if documents is not None:
        train_docs, heldout_docs = sources.split_documents(documents, seed=args.seed)
    else:
        train_files, heldout_files = corpus.split_files(corpus.stdlib_source_files(), seed=args.seed)
        train_docs, heldout_docs = sources.TextFiles(train_files), sources.TextFiles(heldout_files)
    if args.max_files:
        train_docs = sources.Subset(train_docs, range(min(args.max_files, len(train_docs))))
        heldout_docs = sources.Subset(heldout_docs, range(min(max(1, args.max_files // 20), len(heldout_docs))))
    if multihost.is_main_process() and not (out / "tokenizer.json").exists():
        t = time.perf_counter()
        n = min(len(train_docs), TOKENIZER_DOCS)
        tok = tok_lib.train_bpe((train_docs[i] for i in range(n)), vocab_size=cfg.vocab_size)
        tok_lib.save_tokenizer(tok, out)
        print(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens, trained on {n} "
              f"documents in {time.perf_counter() - t:.1f}s")
    multihost.barrier("tokenizer.json")    # the other processes read the one process 0 wrote
    tok = tok_lib.load_tokenizer(out)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ConfigError(f"config key `vocab_size`: {cfg.vocab_size} < tokenizer's {tok.get_vocab_size()}; "
                          "raise vocab_size")
    heldout_tokens = data_batches.encode_documents(
        tok, [heldout_docs[i] for i in range(min(len(heldout_docs), TOKENIZER_DOCS))])
    print(f"data: {len(train_docs):,} train documents, {len(heldout_docs):,} held-out documents "
          f"({heldout_tokens.size:,} tokens)")
    return tok, train_docs, heldout_tokens


# Dense bf16 peak FLOP/s by device kind (vendor figures), for MFU.
_PEAK_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "TPU v5p": 459e12, "TPU v6e": 918e12,
               "TPU v5 lite": 197e12}


def _peak_flops(peak_tflops: float | None) -> float | None:
    if peak_tflops:
        return peak_tflops * 1e12
    return _PEAK_FLOPS.get(jax.devices()[0].device_kind)


def _mesh(args) -> Mesh | None:
    """The --mesh (over the devices of every process), or None: one device."""
    if args.mesh:
        mesh = sharding.make_mesh(args.mesh)
        jax.set_mesh(mesh)                   # the steps lay out their activations on it (context parallelism)
        return mesh
    if jax.process_count() > 1:
        raise ValueError(f"{jax.process_count()} processes train one model over a mesh of all their devices; "
                         f"give --mesh (e.g. --mesh data={jax.device_count()})")
    return None


def _place_state(mesh: Mesh | None, params, rest, tx):
    """-> (params, rest, optimizer state) on `mesh` (params by TRAINING_RULES, the optimizer state
    like its params, everything else replicated; each process fills its own shards), or on one
    device."""
    if mesh is None:
        return params, rest, tx.init(params)
    params = sharding.shard_params(params, mesh, sharding.TRAINING_RULES)
    replicate = lambda x: multihost.global_array(x, multihost.replicated(mesh))
    on_mesh = lambda x: x if getattr(x.sharding, "mesh", None) == mesh else replicate(x)
    opt_state = jax.tree.map(on_mesh, tx.init(params))        # scalars (step counts) replicated
    return params, jax.tree.map(replicate, rest), opt_state


class _BatchPlacement(NamedTuple):
    """Where the rows of batches of `shape` [B, L] go: split over the data axis of the mesh."""

    rows: range                     # the rows of every batch that this process's devices hold
    from_rows: Callable             # int [len(rows), L], this process's rows -> global [B, L]
    from_host: Callable             # int [B, L], the same on every process -> global [B, L]


def _batch_placement(mesh: Mesh | None, shape: tuple[int, int]) -> _BatchPlacement:
    if mesh is None:
        return _BatchPlacement(range(shape[0]), jnp.asarray, jnp.asarray)
    batch = sharding.batch_sharding(mesh, shape)   # checks that data divides B and context divides L
    return _BatchPlacement(multihost.process_rows(batch, shape),
                           lambda x: jax.make_array_from_process_local_data(batch, x, shape),
                           lambda x: multihost.global_array(x, batch))


def _attention_impl(impl: str, form: str, seq_len: int) -> str:
    if impl == "auto" and form == "absorbed" and seq_len > 8192 and jax.default_backend() == "tpu":
        return "xla"
    return impl


def _check_stages(args, form: str) -> None:
    """Refuses, before any work, a dense warm-up that would need [S, S] matrices it cannot hold."""
    if form == "absorbed" and args.dense_steps > 0 and args.indexer_weight > 0:
        raise ValueError(
            f"the dense warm-up trains the indexer on the full attention matrix, which the absorbed "
            f"form (--seq-len {args.seq_len}) does not build; warm the indexer up at a shorter "
            f"--seq-len (<= {EXPANDED_MAX_LEN}, or --attention-form expanded) and continue with "
            f"--dense-steps 0, or pass --indexer-weight 0 for dense steps without the indexer loss")


def _max_segments(segment_ids, stage: str, form: str) -> int | None:
    """The static segment bound of dense absorbed-form steps (cuDNN's packed kernel, see
    `train_step`) from the most segments of any row on any process (`segments.segment_bound`).
    None where it is not used."""
    if stage != "dense" or form != "absorbed":
        return None
    return segment_bound(max(multihost.allgather_json(count_segments(segment_ids))))


def _bar(step: int, total: int, width: int = 20) -> str:
    filled = width * step // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}]"


def _write_run_files(args, cfg, out: Path) -> None:
    """config.yaml (a resumed run's was checked to be the same) and the --init-from-hf tokenizer."""
    if not (args.resume and (out / "config.yaml").exists()):
        save_config(cfg, out / "config.yaml")
    hf_tokenizer = Path(args.init_from_hf or ".") / "tokenizer.json"
    if args.init_from_hf and hf_tokenizer.exists() and not (out / "tokenizer.json").exists():
        shutil.copy(hf_tokenizer, out / "tokenizer.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        multihost.join_from_flags(args)    # before the first jax computation
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with multihost.stdout_of_main_process_only():
        return _train(args)


def _train(args) -> int:
    out = Path(args.out).absolute()
    try:
        cfg = load_config(args.config or (Path(args.init_from_hf) / "config.json" if args.init_from_hf
                                          else "configs/tiny.yaml"))
        if args.resume and (out / "config.yaml").exists():
            check_same_config(load_config(out / "config.yaml"), cfg, str(out))
        _check_stages(args, attention_form(args.attention_form, args.seq_len))
        mesh = _mesh(args)
        feed = _batch_placement(mesh, (args.batch_size, args.seq_len))
        data_shards = args.data_shards or jax.process_count()
        shards_read = pipeline.shards_of_rows(feed.rows, args.batch_size, data_shards)
        if args.init_from_hf:  # before the corpus work: a checkpoint that does not fit fails at once
            from glm_jax.convert import load_hf_checkpoint
            model = load_hf_checkpoint(args.init_from_hf, config=cfg)
        documents = sources.open_documents(args.data) if args.data else None
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if multihost.is_main_process():
        _write_run_files(args, cfg, out)
    tok, train_docs, heldout_tokens = prepare_data(args, cfg, out, documents)
    encode = pipeline.token_encoder(tok)

    if not args.init_from_hf:
        model = GLMModel(cfg, rngs=nnx.Rngs(args.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx, schedule = make_optimizer(args.lr, args.steps, args.warmup_steps)
    params, rest, opt_state = _place_state(mesh, params, rest, tx)
    if mesh is not None:
        print(f"mesh: {sharding.format_mesh(mesh)} over {mesh.size} devices of {jax.process_count()} process(es); "
              f"data in {data_shards} shard(s), this process reading {len(shards_read)}")
    print(f"model: {cfg.name}, {count_params(model):,} parameters, pattern {cfg.pattern}")

    try:
        batches = pipeline.PackedBatches(train_docs, encode, seq_len=args.seq_len, batch_size=args.batch_size,
                                         seed=args.seed, shards=data_shards, read=shards_read)
    except ValueError as e:       # e.g. fewer documents than data shards
        print(f"error: {e}", file=sys.stderr)
        return 2
    heldout = list(data_batches.heldout_batches(heldout_tokens, args.seq_len, args.batch_size,
                                                args.eval_batches))
    mngr = checkpointing.manager(out)
    start = 0
    if args.resume:
        found = checkpointing.restore_latest(mngr, {"params": params, "opt_state": opt_state})
        if found is None:
            print("resume: no checkpoint yet, starting from step 0")
        else:
            start, state, meta = found
            params, opt_state = state["params"], state["opt_state"]
            try:
                batches = pipeline.PackedBatches.from_state(train_docs, encode, meta["data"], shards=data_shards,
                                                            read=shards_read)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"resume: continuing from step {start}")

    form = attention_form(args.attention_form, args.seq_len)
    kernels = ops.KernelChoice(attention=_attention_impl(args.attention_impl, form, args.seq_len))
    weights = LossWeights(indexer=args.indexer_weight, mtp=args.mtp_weight, mtp_depth=args.mtp_depth,
                          kv_share=not args.no_mtp_kv_share, tv=args.tv_weight)
    metrics_file = (Path(args.metrics_file or out / "metrics.jsonl").open("a") if multihost.is_main_process()
                    else open(os.devnull, "w"))
    peak = _peak_flops(args.peak_tflops)
    active = costs.active_params(cfg, params_by_part(abstract_model(cfg)))
    stop_requested = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))  # preemption: save, then exit
    tokens_per_step = args.batch_size * args.seq_len
    t_last, step = time.perf_counter(), start
    steps_since = real_since = 0        # since the last logged step; real: this process's non-padding tokens
    for step in range(start + 1, args.steps + 1):
        batch = next(batches)
        steps_since += 1
        real_since += int(batch.loss_mask.sum())
        stage = "dense" if step <= args.dense_steps else "sparse"
        params, opt_state, terms = train_step(graphdef, params, rest, opt_state, feed.from_rows(batch.inputs),
                                              feed.from_rows(batch.targets), feed.from_rows(batch.segment_ids),
                                              tx=tx, stage=stage, weights=weights, kernels=kernels,
                                              remat=args.remat, form=form,
                                              max_segments=_max_segments(batch.segment_ids, stage, form))
        record = {"step": step, "stage": stage, "lr": float(schedule(step - 1))}
        if step % args.log_every == 0 or step == args.steps or step == start + 1:
            record.update({k: float(v) for k, v in terms.items()})
            now = time.perf_counter()
            record["tokens_per_s"] = tokens_per_step * steps_since / (now - t_last)
            record["real_tokens_per_s"] = sum(multihost.allgather_json(real_since)) / (now - t_last)
            steps_since = real_since = 0
            flops = costs.training_flops_per_token(cfg, args.seq_len, active, sparse=stage == "sparse",
                                                   positions=batch.positions)
            if peak:
                record["mfu"] = record["tokens_per_s"] * flops / peak
            t_last = now
            print(f"step {step:5d}/{args.steps} [{stage}] loss {record['loss']:.3f} lm {record['lm']:.3f} "
                  f"idx_kl {record['indexer_kl']:.3f} mtp {record.get('mtp', 0):.3f} "
                  f"lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s "
                  f"({record['real_tokens_per_s']:.0f} not padding)"
                  + (f" MFU {record['mfu']:.1%}" if "mfu" in record else "") + f"  {_bar(step, args.steps)}",
                  flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            val = float(np.mean([eval_step(graphdef, params, rest, feed.from_host(x), feed.from_host(y),
                                           stage=stage, kernels=kernels) for x, y in heldout]))
            record["val_lm"] = val
            print(f"step {step:5d} validation lm loss {val:.3f} (held-out files)", flush=True)
        if len(record) > 3:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if args.stop_after is not None and step - start >= args.stop_after:
            stop_requested.append(True)
        stop = multihost.any_process(bool(stop_requested))     # all processes stop at the same step
        if step % args.save_every == 0 or step == args.steps or stop:
            data = pipeline.merge_states(multihost.allgather_json(batches.state()))   # every process's shards
            checkpointing.save(mngr, step, {"params": params, "opt_state": opt_state},
                               {"step": step, "data": data, "config": cfg.to_dict()})
        if stop:
            mngr.wait_until_finished()
            print(f"stopped: saved step {step}; continue with --resume", flush=True)
            return 0
    mngr.wait_until_finished()
    metrics_file.close()
    nnx.update(model, params, rest)
    save_model_dir(out, model, dtype=args.export_dtype, tokenizer_file=out / "tokenizer.json")
    print(f"done: {step} steps; model written to {out} (decode with: python decode.py --checkpoint {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
