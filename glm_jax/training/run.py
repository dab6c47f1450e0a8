"""One training run as train.py drives it: `setup` (config, mesh, data, model and optimizer
state, resume), `train` (the loop), `MetricsLog` (progress lines and metrics.jsonl),
`save_checkpoint` and `export`. Its settings are a `run_config.TrainConfig`.

The run directory receives tokenizer.json, config.yaml, run_config.yaml (the run's settings,
compared by a --resume: `run_config.resume_changes`), checkpoints/ (orbax: params, optimizer
state, data position), params/ (the final weights, or a --stop-after stop's) and metrics.jsonl. Several processes share
it: process 0 writes the files, all of them write and read the checkpoints together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from glm_jax.extras import require

tqdm = require("tqdm").tqdm       # before the other extras': a core install hears of the train extra

from glm_jax import costs, faults, multihost, ops, sharding  # noqa: E402 (after the check)
from glm_jax.checkpoint import ModelSource, check_same_config, load_model, save_model_dir
from glm_jax.checkpoint_damage import os_reason, silence_orbax_leftovers
from glm_jax.config import ConfigError, GLMConfig, extend_context, load_config, save_config
from glm_jax.data import batches as data_batches
from glm_jax.data import corpus, pipeline, sources, tokenizer as tok_lib
from glm_jax.data.prefetch import Prefetched
from glm_jax.kernel_configs import configured
from glm_jax.layers.segments import count_segments, segment_bound
from glm_jax.model import GLMModel, abstract_model, count_params, init_model, params_by_part
from glm_jax.training import background_output, checkpointing, run_config
from glm_jax.training.compiles import CompileWatch
from glm_jax.training.run_config import DataConfig, KernelsConfig, ModelSourceConfig, TrainConfig
from glm_jax.training.step import (Batch, LearningRateSchedule, OptimizerConfig, StepConfig, TrainState,
                                   attention_form, eval_step, train_step, train_step_keeping)

DEFAULT_CONFIG = "configs/tiny.yaml"
TOKENIZER_DOCS = 20_000  # documents the tokenizer is trained on (and the most held-out ones encoded)
# Dense bf16 peak FLOP/s by device kind (vendor figures), for MFU.
_PEAK_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "TPU v5p": 459e12, "TPU v6e": 918e12,
               "TPU v5 lite": 197e12}


@dataclasses.dataclass
class Run:
    """What the loop needs, from `setup`; params and opt_state advance with the steps."""

    settings: TrainConfig
    cfg: GLMConfig
    out: Path
    model: GLMModel
    graphdef: nnx.GraphDef
    params: nnx.State
    rest: nnx.State
    opt_state: optax.OptState
    tx: optax.GradientTransformation
    schedule: LearningRateSchedule
    feed: _BatchPlacement
    batches: pipeline.PackedBatches   # wrapped in `Prefetched` while the loop runs, if --prefetch-batches
    heldout: list
    mngr: object          # orbax CheckpointManager (checkpointing.manager)
    start: int            # the step restored (0: a new run)
    form: str             # attention form (training.step.attention_form)
    kernels: ops.KernelChoice
    step_config: StepConfig   # the train step's static settings (its stage and max_segments set per step)
    step: Callable        # train_step, on a mesh with the state's layouts pinned (`_step_for`)
    prefetch: int         # batches packed ahead on a thread while the loop runs (`prefetch_depth`)
    exported: int | None = None   # the step whose weights `export` wrote to params/, if it ran


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
    form = attention_form(settings.kernels.attention_form, data.seq_len)
    prefetch = prefetch_depth(data.prefetch_batches)
    kernels = kernel_choice(settings.kernels)        # a config the kernels do not take is refused here
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
    schedule_settings = settings.schedule
    optimizer = OptimizerConfig.of(schedule_settings)
    tx, schedule = optimizer.build()
    params, rest, opt_state = _place_state(mesh, params, rest, tx)
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

    step_config = StepConfig.of(settings, kernels=kernels, form=form)
    return Run(settings=settings, cfg=cfg, out=out, model=model, graphdef=graphdef, params=params, rest=rest,
               opt_state=opt_state, tx=tx, schedule=schedule, feed=feed, batches=batches, heldout=heldout,
               mngr=mngr, start=start, form=form, kernels=kernels, step_config=step_config,
               step=_step_for(mesh, params, opt_state), prefetch=prefetch)


def model_source(model: ModelSourceConfig) -> ModelSource | None:
    """The weights a run starts from: --hf-checkpoint or --checkpoint (one at most), or None."""
    if model.hf_checkpoint and model.checkpoint:
        raise ValueError("--hf-checkpoint and --checkpoint both name the weights to start from; give one")
    return ModelSource.of(checkpoint=model.checkpoint, hf_checkpoint=model.hf_checkpoint)


def run_model_config(source_cfg: GLMConfig, settings: TrainConfig) -> GLMConfig:
    """The model config of the run: the source's, its positions extended to --context-length
    (`extend_context`); ValueError where --seq-len is longer than the positions it has."""
    length = settings.model.context_length
    cfg = extend_context(source_cfg, length) if length else source_cfg
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


def kernel_choice(kernels: KernelsConfig) -> ops.KernelChoice:
    """The kernels of the run's settings, their configs set (`kernel_configs.configured`)."""
    return configured(ops.KernelChoice(indexer_topk=kernels.indexer_impl, sparse_mla=kernels.attention_impl),
                      kernels.kernel_config)


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


# ---------------------------------------------------------------------- the loop
def train(run: Run) -> int:
    """Steps run.start + 1 .. --steps (or --stop-after of them, or until SIGTERM on some process:
    then a checkpoint and exit), evaluating, logging and saving on the way; then the export."""
    source, depth = run.batches, run.prefetch
    if depth:
        run.batches = Prefetched(source, depth=depth)   # the next batches are packed while the device runs
    try:
        with (StopSignals() as stop_requested, background_output.routed_to(run.out / "background.log"),
              CompileWatch() as compiles):
            return _loop(run, stop_requested, compiles)
    finally:
        if depth:
            run.batches.close()
            run.batches = source


def prefetch_depth(setting: int | None) -> int:
    """data.prefetch_batches, or by default 2 on an accelerator and 0 on a CPU (there the
    packing thread would take the cores the step runs on)."""
    if setting is not None:
        return setting
    return 0 if jax.default_backend() == "cpu" else 2


def _loop(run: Run, stop_requested: "StopSignals", compiles: CompileWatch) -> int:
    settings, schedule = run.settings, run.settings.schedule
    log = MetricsLog(settings, run.cfg, run.out, start=run.start, compiles=compiles)
    segment_bounds = SegmentBounds()
    step = run.start
    for step in range(run.start + 1, schedule.steps + 1):
        batch = next(run.batches)
        stage = "dense" if step <= schedule.dense_steps else "sparse"
        config = dataclasses.replace(run.step_config, stage=stage,
                                     max_segments=segment_bounds.for_step(batch.segment_ids, stage, run.form))
        state, terms = run.step(TrainState(run.graphdef, run.params, run.rest, run.opt_state),
                                Batch(*(run.feed.from_rows(a) for a in (batch.inputs, batch.targets,
                                                                        batch.segment_ids))), config)
        run.params, run.opt_state = state.params, state.opt_state
        faults.reached("step", step)
        record = log.step(step, stage, lambda: run.schedule.on_host(step - 1), terms, batch,
                          full=step % settings.logging.log_every == 0 or step == schedule.steps
                          or step == run.start + 1)
        if step % settings.logging.eval_every == 0 or step == schedule.steps:
            log.validation(record, evaluate(run, stage))
        log.write(record)
        limit = settings.stop_after is not None and step - run.start >= settings.stop_after
        if limit:
            stop_requested.request()
        stop = multihost.any_process(stop_requested.requested)  # all processes stop at the same step
        if step % settings.checkpointing.save_every == 0 or step == schedule.steps or stop:
            save_checkpoint(run, step)
        if stop:
            finish_saves(run)
            log.close()
            if limit:               # a planned stop: its weights decode as they are
                export(run, step)
                print(f"stopped: saved step {step} and exported its weights to {run.out}; continue with --resume",
                      flush=True)
            else:                   # a signal: no time for more writing than the checkpoint
                print(f"stopped: saved step {step}; continue with --resume (a run stopped by --stop-after "
                      "also exports the weights that decode.py reads)", flush=True)
            return 0
    log.close()
    export(run, step)
    print(f"done: {step} steps; model written to {run.out}")
    return 0


class StopSignals:
    """Within: SIGTERM (preemption) and a first Ctrl-C (SIGINT) ask the loop to save a checkpoint
    at the end of the step and exit; a second Ctrl-C quits at once (KeyboardInterrupt). The
    previous handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self._interrupts = 0
        self._previous = {}

    def request(self) -> None:
        self.requested = True

    def _handle(self, signum, _frame) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
            print("\ninterrupted: saving a checkpoint after this step, then exiting "
                  "(Ctrl-C again to quit at once, losing the steps since the last save)", file=sys.stderr, flush=True)
        self.request()

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():   # handlers can only be set there
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class SegmentBounds:
    """The static segment bound of dense absorbed-form steps (cuDNN's packed kernel, see
    `train_step`): the largest `segments.segment_bound` of any batch so far on any process. It
    never goes down, so a run compiles the step once per bound it reaches (a few times at most:
    the bounds are powers of two), not each time the batches' segment counts cross a bound."""

    def __init__(self):
        self.bound = 0

    def for_step(self, segment_ids, stage: str, form: str) -> int | None:
        """segment_ids int [rows, L] of this process -> the bound, or None where it is not used."""
        if stage != "dense" or form != "absorbed":
            return None
        self.bound = max(self.bound, segment_bound(max(multihost.allgather_json(count_segments(segment_ids)))))
        return self.bound


def evaluate(run: Run, stage: str) -> float:
    """The mean LM loss over the held-out batches."""
    return float(np.mean([eval_step(run.graphdef, run.params, run.rest, run.feed.from_host(x),
                                    run.feed.from_host(y), stage=stage, kernels=run.kernels)
                          for x, y in run.heldout]))


class SaveFailedError(RuntimeError):
    """A checkpoint or the final weights could not be written (a full disk, a lost mount)."""


def save_checkpoint(run: Run, step: int) -> None:
    """Params, optimizer state and every process's data position at `step` (async; all processes).
    A failure of this save or of the previous one raises SaveFailedError."""
    data = pipeline.merge_states(multihost.allgather_json(run.batches.state()))   # every process's shards
    faults.reached("save", step)
    with _save_failures(f"checkpoint {step}", run):
        checkpointing.save(run.mngr, step, {"params": run.params, "opt_state": run.opt_state},
                           {"step": step, "data": data, "config": run.cfg.to_dict()})
    faults.reached("saving", step)


def finish_saves(run: Run) -> None:
    """Wait for the asynchronous checkpoint writes; SaveFailedError if one failed."""
    with _save_failures("the last checkpoint", run):
        run.mngr.wait_until_finished()


@contextlib.contextmanager
def _save_failures(what: str, run: Run):
    """Within: an exception from orbax's writer becomes SaveFailedError saying what was being
    saved, the cause in one line, and which complete checkpoint a --resume would continue from."""
    try:
        with background_output.library_logs_too():
            yield
    except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many kinds
        silence_orbax_leftovers()
        kept = _complete_checkpoints(run)
        raise SaveFailedError(
            f"saving {what} to {run.out} failed: {os_reason(error)} (details: background.log); "
            + (f"the complete checkpoint of step {kept[-1]} is kept (continue from it with --resume once "
               "the disk has room)" if kept else "no complete checkpoint is kept yet")) from error


def _complete_checkpoints(run: Run) -> list[int]:
    """The steps whose checkpoint directories orbax finished (no temporary suffix)."""
    root = run.out / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


def export(run: Run, step: int) -> None:
    """The weights of `step` as a model directory in the run directory (what decode.py
    --checkpoint loads)."""
    finish_saves(run)
    nnx.update(run.model, run.params, run.rest)
    with _save_failures(f"the weights of step {step}", run):
        save_model_dir(run.out, run.model, dtype=run.settings.checkpointing.export_dtype,
                       tokenizer_file=run.out / "tokenizer.json")
    run.exported = step


# ---------------------------------------------------------------------- metrics
def drop_records_after(path: Path, step: int) -> int:
    """Rewrite the metrics file without the records of steps after `step` (written by a run
    that stopped before it could save them, and run again from `step` by this one) and without a
    line cut short by a crash -> the number of lines dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(record, dict) and record.get("step", 0) > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return dropped


class MetricsLog:
    """The progress lines on stdout and one JSON object per logged step in --metrics-file
    (process 0 only): loss terms, lr, tokens/s (whole rows; real: without the packer's padding,
    summed over the processes) since the last logged step, MFU when the peak is known."""

    def __init__(self, settings: TrainConfig, cfg: GLMConfig, out: Path, start: int = 0,
                 compiles: CompileWatch | None = None):
        self.steps, self.seq_len = settings.schedule.steps, settings.data.seq_len
        self.compiles = compiles
        self.steady = []        # tokens/s of the logged intervals in which nothing compiled
        self.start, self.t_start = start, time.perf_counter()
        # The bar (stderr, a terminal only): step, elapsed and time left, s/step, loss, memory.
        self.bar = tqdm(total=self.steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=None if multihost.is_main_process() else True, leave=False)
        self.cfg = cfg
        path = Path(settings.logging.metrics_file or out / "metrics.jsonl")
        if multihost.is_main_process() and start > 0:
            drop_records_after(path, start)
        self.file = path.open("a") if multihost.is_main_process() else open(os.devnull, "w")
        self.peak = _peak_flops(settings.logging.peak_tflops)
        self.active = costs.active_params(cfg, params_by_part(abstract_model(cfg)))
        self.tokens_per_step = settings.data.batch_size * self.seq_len
        self.t_last = time.perf_counter()
        self.steps_since = self.real_since = 0  # since the last logged step; real: this process's non-padding tokens

    def step(self, step: int, stage: str, lr: Callable[[], float], terms: dict, batch, *, full: bool) -> dict:
        """The record of a step; `full`: with its learning rate (`lr()`), loss terms and speed,
        printed. Every process must call it (a full record gathers the tokens of every process).
        Only a full record reads anything back from the device."""
        self.steps_since += 1
        self.real_since += int(batch.loss_mask.sum())
        self.bar.update(1)
        record = {"step": step, "stage": stage}
        if not full:
            return record
        record["lr"] = lr()
        record.update({k: float(v) for k, v in terms.items()})
        now = time.perf_counter()
        record["tokens_per_s"] = self.tokens_per_step * self.steps_since / (now - self.t_last)
        record["real_tokens_per_s"] = sum(multihost.allgather_json(self.real_since)) / (now - self.t_last)
        self.steps_since = self.real_since = 0
        built, compile_s = self.compiles.since_last() if self.compiles else (0, 0.0)
        if built:
            record["compiled"], record["compile_s"] = built, compile_s
        else:
            self.steady.append(record["tokens_per_s"])
        flops = costs.training_flops_per_token(self.cfg, self.seq_len, self.active, sparse=stage == "sparse",
                                               positions=batch.positions)
        if self.peak:
            record["mfu"] = record["tokens_per_s"] * flops / self.peak
        self.t_last = now
        per_step = (now - self.t_start) / max(step - self.start, 1)
        record["memory_gib"] = memory_in_use() / 2**30
        self.bar.set_postfix_str(f"loss {record['loss']:.3f}, {record['memory_gib']:.1f} GiB", refresh=False)
        tqdm.write(f"step {step:5d}/{self.steps} [{stage}] loss {record['loss']:.3f} lm {record['lm']:.3f} "
                   f"idx_kl {record['indexer_kl']:.3f} mtp {record.get('mtp', 0):.3f} "
                   f"lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s "
                   f"({record['real_tokens_per_s']:.0f} not padding)"
                   + (f" MFU {record['mfu']:.1%}" if "mfu" in record else "")
                   + f" | {per_step:.2f} s/step, {_clock((self.steps - step) * per_step)} left, "
                     f"{record['memory_gib']:.2f} GiB"
                   + (f" | compiled {built} program(s) in {compile_s:.1f} s" if built else ""), file=sys.stdout)
        sys.stdout.flush()
        return record

    def validation(self, record: dict, val: float) -> None:
        record["val_lm"] = val
        tqdm.write(f"step {record['step']:5d} validation lm loss {val:.3f} (held-out files)", file=sys.stdout)
        sys.stdout.flush()

    def write(self, record: dict) -> None:
        """Writes a record that holds more than step and stage."""
        if len(record) > 2:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.compiles is not None:
            steady = (f"steady {np.median(self.steady):,.0f} tokens/s (median of {len(self.steady)} logged "
                      "intervals without compilation)" if self.steady else "no logged interval without compilation")
            print(f"compiled: {self.compiles.summary()}; {steady}", flush=True)


def _peak_flops(peak_tflops: float | None) -> float | None:
    if peak_tflops:
        return peak_tflops * 1e12
    return _PEAK_FLOPS.get(jax.devices()[0].device_kind)


def memory_in_use() -> int:
    """Bytes in use at the peak so far: the first local accelerator's allocator peak where it
    reports one (GPU, TPU), else this process's peak resident memory (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024       # KiB on Linux


def _clock(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
