"""Training checkpoints: params, optimizer state, data position and step in one orbax manager.

Layout under the run directory:  checkpoints/<step>/{state, meta}
`meta` (JSON) holds the step, the data iterator's state and the config, so a resume can check
that it continues the same run.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


def manager(run_dir: str | Path, *, keep: int = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options,
                                 item_names=("state", "meta"))


def save(mngr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)))


def restore_latest(mngr: ocp.CheckpointManager, abstract_state):
    """-> (step, state, meta) of the newest checkpoint, or None if there is none."""
    step = mngr.latest_step()
    if step is None:
        return None
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_state)
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                          meta=ocp.args.JsonRestore()))
    return step, restored["state"], restored["meta"]
