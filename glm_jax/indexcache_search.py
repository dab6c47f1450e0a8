"""Training-free IndexCache search for an IndexShare pattern (REFERENCE section 3).

Start from the model's pattern (all-Full for DeepSeek-V3.2-style checkpoints) and repeatedly flip
to Shared the layer whose flip gives the lowest LM loss on a fixed calibration set; layer 0
stays Full. Each flip prints the pattern and its loss; the state file records every candidate
evaluated, so an interrupted search continues where it stopped (and a finished one continues
with a larger --flips).

Its command line is `python -m glm_jax.frontends.indexcache_search`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm_jax.convert.repattern import with_pattern
from glm_jax.forward_options import ForwardOptions
from glm_jax.training.step import eval_step


def calibration_loss(model, batches: list[tuple[np.ndarray, np.ndarray]], *,
                     options: ForwardOptions = ForwardOptions()) -> float:
    """Mean LM loss over (inputs, targets) int32 [B, S] pairs, the model called with `options`
    (default: sparse attention in the absorbed form, as the model runs)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    losses = [float(eval_step(graphdef, params, rest, jnp.asarray(x), jnp.asarray(y), options=options))
              for x, y in batches]
    return float(np.mean(losses))


def fingerprint(batches) -> str:
    h = hashlib.sha1()
    for x, y in batches:
        h.update(np.ascontiguousarray(x, np.int32).tobytes() + np.ascontiguousarray(y, np.int32).tobytes())
    return h.hexdigest()[:16]


def flip(pattern: str, layer: int) -> str:
    return pattern[:layer] + "S" + pattern[layer + 1:]


def greedy_search(model, batches, *, flips: int, state_path: Path | None = None,
                  log: Callable[[str], None] = print, evaluate=calibration_loss) -> dict:
    """Flip `flips` layers to Shared in total (counting flips a resumed state already made).

    -> state {"start_pattern", "calibration", "base_loss", "steps": [{"layer", "pattern", "loss",
    "candidates": {layer: loss of flipping it}}],
    "pending": {layer: loss} of the step in progress}; written to state_path after every evaluation."""
    start, calib = model.cfg.pattern, fingerprint(batches)
    state = _load_state(state_path, start, calib, log)
    save = (lambda: state_path.write_text(json.dumps(state, indent=1) + "\n")) if state_path else (lambda: None)
    if state["base_loss"] is None:
        state["base_loss"] = evaluate(model, batches)
        save()
        log(f"start   {start}  loss {state['base_loss']:.5f}")
    while len(state["steps"]) < flips:
        pattern = state["steps"][-1]["pattern"] if state["steps"] else start
        candidates = [i for i in range(1, len(pattern)) if pattern[i] == "F"]
        if not candidates:
            log("every layer but layer 0 is Shared; nothing left to flip")
            break
        for layer in candidates:
            if str(layer) not in state["pending"]:
                state["pending"][str(layer)] = evaluate(with_pattern(model, flip(pattern, layer)), batches)
                save()
        best = min(candidates, key=lambda i: (state["pending"][str(i)], i))
        step = {"layer": best, "pattern": flip(pattern, best), "loss": state["pending"][str(best)],
                "candidates": state["pending"]}
        state["steps"].append(step)
        state["pending"] = {}
        save()
        log(f"flip {len(state['steps']):2d}: layer {best:3d} -> {step['pattern']}  loss {step['loss']:.5f} "
            f"({step['loss'] - state['base_loss']:+.5f})")
    return state


def _load_state(path: Path | None, start: str, calib: str, log) -> dict:
    fresh = {"start_pattern": start, "calibration": calib, "base_loss": None, "steps": [], "pending": {}}
    if path is None or not path.exists():
        return fresh
    state = json.loads(path.read_text())
    if state.get("start_pattern") != start or state.get("calibration") != calib:
        raise ValueError(f"{path} belongs to another search (start pattern {state.get('start_pattern')}, "
                         f"calibration {state.get('calibration')}; now {start}, {calib}); use another --state "
                         "file or the same model and calibration settings")
    log(f"resuming {path}: {len(state['steps'])} flip(s) done, {len(state['pending'])} candidate(s) of the next")
    return state


def calibration_batches(tok, texts: Iterable[str], seq_len: int, batch_size: int, num_batches: int):
    """Fixed windows of the concatenated token stream -> list of (inputs, targets) int32 [B, S]."""
    from glm_jax.data.batches import heldout_batches

    stream = np.concatenate([np.asarray(e.ids, np.int32) for e in tok.encode_batch(list(texts))])
    return list(heldout_batches(stream, seq_len, batch_size, num_batches))
