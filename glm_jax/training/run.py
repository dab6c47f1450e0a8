"""One training run as train.py drives it: `setup` (config, mesh, data, model and optimizer
state, resume) -> a `Run` (`training.run_parts`), which `train` steps (`training.loop`; its metrics: `training.metrics`,
its checkpoints and export: `training.saving`). Its settings are a `run_config.TrainConfig`.

The run directory receives tokenizer.json, config.yaml, run_config.yaml (the run's settings,
compared by a --resume: `run_config.resume_changes`), checkpoints/ (orbax: params, optimizer
state, data position), params/ (the final weights, or a --stop-after stop's) and metrics.jsonl. Several processes share
it: process 0 writes the files, all of them write and read the checkpoints together.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from glm_jax.extras import require

require("tqdm")       # before the other extras': a core install hears of the train extra

from glm_jax import multihost, sharding  # noqa: E402 (after the check)
from glm_jax.checkpoint import ModelSource, check_same_config, load_model
from glm_jax.config import ConfigError, GLMConfig, extend_context, load_config, save_config
from glm_jax.data import batches as data_batches
from glm_jax.data import corpus, pipeline, sources, tokenizer as tok_lib
from glm_jax.model import GLMModel, abstract_model, count_params, init_model
from glm_jax.training import checkpointing, run_config
from glm_jax.training.loop import SegmentBounds, StopSignals, train  # noqa: F401 - run.train(run.setup(...))
from glm_jax.training.run_parts import BatchPlacement, Run
from glm_jax.training.run_config import DataConfig, ModelSourceConfig, TrainConfig
from glm_jax.training.saving import SaveFailedError  # noqa: F401 - what train.py reports as exit code 1
from glm_jax.training.step import StepConfig, TrainState, train_step, train_step_keeping

DEFAULT_CONFIG = "configs/tiny.yaml"
TOKENIZER_DOCS = 20_000  # documents the tokenizer is trained on (and the most held-out ones encoded)


# ---------------------------------------------------------------------- setup
def setup(settings: TrainConfig) -> Run:
    """Everything the first step needs. Raises the errors a user causes (ValueError,
    FileNotFoundError) where the settings or files are wrong, those of the settings and the
    model source before the run directory is created."""
    out = Path(settings.out).absolute()
    source = model_source(settings.model)
    source_cfg = load_config(settings.model.config or (source.config_file if source else DEFAULT_CONFIG))
    cfg = run_model_config(source_cfg, settings)
    data = settings.data
    data_shards = data.data_shards or jax.process_count()
    settings = dataclasses.replace(settings, data=dataclasses.replace(data, data_shards=data_shards))
    old = run_config.load(out / run_config.FILE_NAME) if (out / run_config.FILE_NAME).exists() else None
    if settings.resume and (out / "config.yaml").exists():
        if old is not None and old.model.context_length != settings.model.context_length:
            run_config.resume_changes(old, settings)     # refuses the change, naming the flag
        check_same_config(load_config(out / "config.yaml"), cfg, str(out))
    if settings.resume and out.is_dir():
        for line in run_config.resume_changes(old, settings):
            print(line)
    prefetch = prefetch_depth(data.prefetch_batches)
    step_config = StepConfig.of(settings)        # a config the kernels do not take is refused here
    mesh = _mesh(settings.mesh)
    feed = _batch_placement(mesh, (data.batch_size, data.seq_len))
    shards_read = pipeline.shards_of_rows(feed.rows, data.batch_size, data_shards)
    # before the corpus work: a checkpoint that does not fit fails at once
    model = with_config(load_model(source, config=source_cfg), cfg) if source else None
    documents = sources.open_documents(data.data) if data.data else None
    heldout_documents = sources.open_documents(data.heldout_data) if data.heldout_data else None

    out.mkdir(parents=True, exist_ok=True)
    if multihost.is_main_process():
        _write_run_files(settings, cfg, out, source)
    tok, train_docs, heldout_tokens = prepare_data(data, cfg, out, documents, heldout_documents, seed=settings.seed)
    encode = pipeline.token_encoder(tok)

    if model is None:
        model = init_model(cfg, settings.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest, opt_state = _place_state(mesh, params, rest, step_config.tx)
    if mesh is not None:
        print(f"mesh: {sharding.format_mesh(mesh)} over {mesh.size} devices of {jax.process_count()} process(es); "
              f"data in {data_shards} shard(s), this process reading {len(shards_read)}")
    print(f"model: {cfg.name}, {count_params(model):,} parameters, pattern {cfg.pattern}")

    batches = pipeline.PackedBatches(train_docs, encode, seq_len=data.seq_len, batch_size=data.batch_size,
                                     seed=settings.seed, shards=data_shards, read=shards_read)
    heldout = list(data_batches.heldout_batches(heldout_tokens, data.seq_len, data.batch_size,
                                                settings.logging.eval_batches))
    mngr = checkpointing.manager(out)
    start = 0
    if settings.resume:
        found = checkpointing.restore_latest(mngr, {"params": params, "opt_state": opt_state})
        if found is None:
            print("resume: no checkpoint yet, starting from step 0")
        else:
            start, state, meta = found
            params, opt_state = state["params"], state["opt_state"]
            batches = pipeline.PackedBatches.from_state(train_docs, encode, meta["data"], shards=data_shards,
                                                        read=shards_read)
            print(f"resume: continuing from step {start}")

    return Run(settings=settings, cfg=cfg, out=out, model=model, graphdef=graphdef, rest=rest, feed=feed,
               batches=batches, heldout=heldout, mngr=mngr, step_config=step_config,
               train_step=_step_for(mesh, params, opt_state), prefetch=prefetch,
               initial=TrainState(graphdef, params, rest, opt_state, start))


def model_source(model: ModelSourceConfig) -> ModelSource | None:
    """The weights a run starts from: --hf-checkpoint or --checkpoint (one at most), or None."""
    if model.hf_checkpoint and model.checkpoint:
        raise ValueError("--hf-checkpoint and --checkpoint both name the weights to start from; give one")
    return ModelSource.of(checkpoint=model.checkpoint, hf_checkpoint=model.hf_checkpoint)


def run_model_config(source_cfg: GLMConfig, settings: TrainConfig) -> GLMConfig:
    """The model config of the run: the source's, its positions extended to --context-length
    (`extend_context`), its indexer's top-k set to --index-topk; ValueError where --seq-len is
    longer than the positions it has."""
    length = settings.model.context_length
    cfg = extend_context(source_cfg, length) if length else source_cfg
    if settings.model.index_topk:
        cfg = dataclasses.replace(cfg, index_topk=settings.model.index_topk)
    seq_len = settings.data.seq_len
    if seq_len > cfg.max_position_embeddings:
        hint = (f"a --context-length of at least {seq_len}" if not length else
                f"--context-length {seq_len} or more")
        raise ValueError(f"--seq-len {seq_len} is longer than the model's {cfg.max_position_embeddings} positions "
                         f"(max_position_embeddings); extend them with {hint}, or shorten --seq-len")
    return cfg


def with_config(model: GLMModel, cfg: GLMConfig) -> GLMModel:
    """`model`'s weights in a model built from `cfg` (a config that changes no weight's shape,
    e.g. the position encoding of `extend_context`); `model` itself where it has that config."""
    if model.cfg == cfg:
        return model
    graphdef, _ = nnx.split(abstract_model(cfg))
    return nnx.merge(graphdef, nnx.state(model))


def prepare_data(data: DataConfig, cfg, out: Path, documents=None, heldout_documents=None, *, seed: int = 0):
    """Tokenizer (trained once, then reused), the training documents and the held-out tokens.

    documents: the training documents of `data.data` (default: the standard library's files,
    split by file); heldout_documents: those of `data.heldout_data` (default: a split of
    documents); seed: the split's."""
    if heldout_documents is not None:
        if documents is None:
            raise ValueError("--heldout-data needs --data (the training documents it is held out from)")
        train_docs, heldout_docs = documents, heldout_documents
    elif documents is not None:
        train_docs, heldout_docs = sources.split_documents(documents, seed=seed)
    else:
        train_files, heldout_files = corpus.split_files(corpus.stdlib_source_files(), seed=seed)
        train_docs, heldout_docs = sources.TextFiles(train_files), sources.TextFiles(heldout_files)
    if data.max_files:
        train_docs = sources.Subset(train_docs, range(min(data.max_files, len(train_docs))))
        heldout_docs = sources.Subset(heldout_docs, range(min(max(1, data.max_files // 20), len(heldout_docs))))
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


def _write_run_files(settings: TrainConfig, cfg, out: Path, source) -> None:
    """config.yaml (a resumed run's was checked to be the same), run_config.yaml and the model
    source's tokenizer."""
    if not (settings.resume and (out / "config.yaml").exists()):
        save_config(cfg, out / "config.yaml")
    run_config.save(settings, out)
    if source is not None and source.tokenizer_file.exists() and not (out / "tokenizer.json").exists():
        shutil.copy(source.tokenizer_file, out / "tokenizer.json")


def _mesh(spec: str | None) -> Mesh | None:
    """The mesh of `spec` (over the devices of every process), or None: one device."""
    if spec:
        mesh = sharding.make_mesh(spec)
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
    if mesh is None:   # committed to the device, as the step returns them: else step 2 compiles again
        commit = lambda tree: jax.device_put(tree, jax.devices()[0])
        return commit(params), commit(rest), commit(tx.init(params))
    params = sharding.shard_params(params, mesh, sharding.TRAINING_RULES)
    replicate = lambda x: multihost.global_array(x, multihost.replicated(mesh))
    on_mesh = lambda x: x if getattr(x.sharding, "mesh", None) == mesh else replicate(x)
    opt_state = jax.tree.map(on_mesh, tx.init(params))        # scalars (step counts) replicated
    return params, jax.tree.map(replicate, rest), opt_state


def _step_for(mesh: Mesh | None, params, opt_state) -> Callable:
    """The train step of the run: on a mesh one that returns params and optimizer state in the
    layouts they were placed in (`train_step_keeping`), so it compiles once per stage."""
    if mesh is None:
        return train_step
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    return train_step_keeping(shardings(params), shardings(opt_state))


def _batch_placement(mesh: Mesh | None, shape: tuple[int, int]) -> BatchPlacement:
    if mesh is None:
        return BatchPlacement(range(shape[0]), jnp.asarray, jnp.asarray)
    batch = sharding.batch_sharding(mesh, shape)   # checks that data divides B and context divides L
    return BatchPlacement(multihost.process_rows(batch, shape),
                           lambda x: jax.make_array_from_process_local_data(batch, x, shape),
                           lambda x: multihost.global_array(x, batch))


def prefetch_depth(setting: int | None) -> int:
    """data.prefetch_batches, or by default 2 on an accelerator and 0 on a CPU (there the
    packing thread would take the cores the step runs on)."""
    if setting is not None:
        return setting
    return 0 if jax.default_backend() == "cpu" else 2

