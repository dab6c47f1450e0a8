"""`Run`: what a training run is made of, built once by `run.setup` and fixed for the run. What
advances step by step is a `step.TrainState` (params, optimizer state, the step count), which
the loop (`training.loop`) holds and each step returns; the data position advances with
`batches`.

Its own module so that the loop and the saving (`training.saving`) can take a Run without
importing `training.run`, which imports them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from flax import nnx

from glm_jax.config import GLMConfig
from glm_jax.data import pipeline
from glm_jax.model import GLMModel
from glm_jax.training.run_config import TrainConfig
from glm_jax.training.step import StepConfig, TrainState


class BatchPlacement(NamedTuple):
    """Where the rows of a run's batches [B, L] go: split over the data axis of the mesh."""

    rows: range                     # the rows of every batch that this process's devices hold
    from_rows: Callable             # int [len(rows), L], this process's rows -> global [B, L]
    from_host: Callable             # int [B, L], the same on every process -> global [B, L]


@dataclasses.dataclass(frozen=True)
class Run:
    """A training run's fixed parts.

    settings: its `TrainConfig`; cfg: the model config; out: the run directory; model: the
    model object `saving.export` writes the weights through; graphdef / rest: the model's
    structure and non-parameter state (`nnx.split(model, nnx.Param, ...)`); feed: the batches'
    placement; batches: the training batches (their iterator holds the data position);
    heldout: the held-out (inputs, targets) int32 [B, L] pairs; mngr: the orbax
    CheckpointManager (`checkpointing.manager`); step_config: the train step's static settings
    (the optimizer, the forward's options, the loss weights; the loop sets the stage and
    max_segments per step); train_step: the step, (TrainState, Batch, StepConfig) -> (TrainState,
    metrics), on a mesh with the state's layouts pinned; prefetch: batches packed ahead on a
    thread while the loop runs; initial: the state of the first step (restored by --resume)."""

    settings: TrainConfig
    cfg: GLMConfig
    out: Path
    model: GLMModel
    graphdef: nnx.GraphDef
    rest: nnx.State
    feed: BatchPlacement
    batches: pipeline.PackedBatches
    heldout: list
    mngr: object
    step_config: StepConfig
    train_step: Callable
    prefetch: int
    initial: TrainState
