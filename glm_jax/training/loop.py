"""A training run's loop (`train`): the steps from `run.setup`'s state, each with its stage and
segment bound (`SegmentBounds`), the evaluations, the metrics, the checkpoints, a stop on
--stop-after or a signal (`StopSignals`), then the export."""

from __future__ import annotations

import signal
import sys
import threading
from typing import NamedTuple

import numpy as np

from glm_jax import faults, multihost
from glm_jax.data.prefetch import Prefetched
from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.segments import count_segments, segment_bound
from glm_jax.training import background_output
from glm_jax.training.compiles import CompileWatch
from glm_jax.training.metrics import MetricsLog
from glm_jax.training.run_parts import Run
from glm_jax.training.saving import export, finish_saves, save_checkpoint
from glm_jax.training.step import TrainState, eval_step


class Finished(NamedTuple):
    """How `train` ended: code, the exit code; state, the last step's `TrainState`; exported,
    whether its weights were written to params/ (the last step, or a --stop-after stop)."""

    code: int
    state: TrainState
    exported: bool


def train(run: Run) -> Finished:
    """Steps run.initial.step + 1 .. --steps (or --stop-after of them, or until SIGTERM on some
    process: then a checkpoint and exit), evaluating, logging and saving on the way; then the
    export."""
    batches = Prefetched(run.batches, depth=run.prefetch) if run.prefetch else run.batches
    try:            # with prefetch the next batches are packed while the device runs
        with (StopSignals() as stop_requested, background_output.routed_to(run.out / "background.log"),
              CompileWatch() as compiles):
            return _loop(run, batches, stop_requested, compiles)
    finally:
        if run.prefetch:
            batches.close()


def _loop(run: Run, batches, stop_requested: "StopSignals", compiles: CompileWatch) -> Finished:
    settings, schedule = run.settings, run.settings.schedule
    state = run.initial
    log = MetricsLog(settings, run.cfg, run.out, start=state.step, compiles=compiles)
    learning_rate = run.step_config.schedule.on_host
    segment_bounds = SegmentBounds()
    form = run.step_config.forward.form
    while state.step < schedule.steps:
        step = state.step + 1
        batch = next(batches)
        stage = "dense" if step <= schedule.dense_steps else "sparse"
        config = run.step_config.with_forward(mode=stage,
                                              max_segments=segment_bounds.for_step(batch.segment_ids, stage, form))
        placed = batch._replace(inputs=run.feed.from_rows(batch.inputs), targets=run.feed.from_rows(batch.targets),
                                segment_ids=run.feed.from_rows(batch.segment_ids))     # positions: the step drops them
        state, terms = run.train_step(state, placed, config)
        faults.reached("step", step)
        record = log.step(step, stage, lambda: learning_rate(step - 1), terms, batch,
                          full=step % settings.logging.log_every == 0 or step == schedule.steps
                          or step == run.initial.step + 1)
        if step % settings.logging.eval_every == 0 or step == schedule.steps:
            log.validation(record, evaluate(run, state, stage))
        log.write(record)
        limit = settings.stop_after is not None and step - run.initial.step >= settings.stop_after
        if limit:
            stop_requested.request()
        stop = multihost.any_process(stop_requested.requested)  # all processes stop at the same step
        if step % settings.checkpointing.save_every == 0 or step == schedule.steps or stop:
            save_checkpoint(run, state, batches)
        if stop:
            finish_saves(run)
            log.close()
            if limit:               # a planned stop: its weights decode as they are
                export(run, state)
                print(f"stopped: saved step {step} and exported its weights to {run.out}; continue with --resume",
                      flush=True)
            else:                   # a signal: no time for more writing than the checkpoint
                print(f"stopped: saved step {step}; continue with --resume (a run stopped by --stop-after "
                      "also exports the weights that decode.py reads)", flush=True)
            return Finished(0, state, exported=limit)
    log.close()
    export(run, state)
    print(f"done: {state.step} steps; model written to {run.out}")
    return Finished(0, state, exported=True)


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


def evaluate(run: Run, state: TrainState, stage: str) -> float:
    """The mean LM loss of `state`'s params over the held-out batches, the attention of `stage`
    in the absorbed form."""
    options = ForwardOptions(mode=stage, form="absorbed", kernels=run.step_config.forward.kernels)
    return float(np.mean([eval_step(run.graphdef, state.params, run.rest, run.feed.from_host(x),
                                    run.feed.from_host(y), options=options)
                          for x, y in run.heldout]))


