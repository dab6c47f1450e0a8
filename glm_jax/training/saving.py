"""What a training run writes to keep its progress: `save_checkpoint` (params, optimizer state
and data position, asynchronously), `finish_saves` and `export` (the weights decode.py loads);
a failed write raises `SaveFailedError` naming the complete checkpoint a --resume would use."""

from __future__ import annotations

import contextlib
from flax import nnx

from glm_jax import faults, multihost
from glm_jax.checkpoint import save_model_dir
from glm_jax.checkpoint_damage import os_reason, silence_orbax_leftovers
from glm_jax.data import pipeline
from glm_jax.training import background_output, checkpointing
from glm_jax.training.run_parts import Run
from glm_jax.training.step import TrainState


class SaveFailedError(RuntimeError):
    """A checkpoint or the final weights could not be written (a full disk, a lost mount)."""


def save_checkpoint(run: Run, state: TrainState, batches) -> None:
    """The params and optimizer state of `state` and every process's data position in `batches`
    (what `run.batches` became while the loop runs) at `state.step` (async; all processes). A
    failure of this save or of the previous one raises SaveFailedError."""
    step = state.step
    data = pipeline.merge_states(multihost.allgather_json(batches.state()))   # every process's shards
    faults.reached("save", step)
    with _save_failures(f"checkpoint {step}", run):
        checkpointing.save(run.mngr, step, {"params": state.params, "opt_state": state.opt_state},
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


def export(run: Run, state: TrainState) -> None:
    """The weights of `state` as a model directory in the run directory (what decode.py
    --checkpoint loads)."""
    finish_saves(run)
    nnx.update(run.model, state.params, run.rest)
    with _save_failures(f"the weights of step {state.step}", run):
        save_model_dir(run.out, run.model, dtype=run.settings.checkpointing.export_dtype,
                       tokenizer_file=run.out / "tokenizer.json")

