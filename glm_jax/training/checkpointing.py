"""Training checkpoints: params, optimizer state, data position and step in one orbax manager.

Layout under the run directory:  checkpoints/<step>/{state, meta}
`meta` (JSON) holds the step, the data iterator's state and the config, so a resume can check
that it continues the same run.
"""

from __future__ import annotations

from pathlib import Path

import jax

from glm_jax.checkpoint_damage import damage_summary, restoring
from glm_jax.extras import require
from glm_jax.multihost import is_main_process

ocp = require("orbax.checkpoint")


def manager(run_dir: str | Path, *, keep: int = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options,
                                 item_names=("state", "meta"))


def save(mngr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)))


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, log=print):
    """-> (step, state, meta) of the newest checkpoint that restores, or None if there is none.

    A corrupt or partially written checkpoint is reported through `log` and skipped in favour
    of the previous one."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=getattr(x, "sharding", None) or default),
                          abstract_state)
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            with restoring():
                restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                      meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - any failure means this checkpoint is unusable
            aside = set_aside(mngr, step)
            log(f"checkpoint {step} cannot be restored: {damage_summary(e)}; "
                + (f"moved to {aside.name}/ so it is not tried again; " if aside else "")
                + "trying the previous one")
            continue
        return step, restored["state"], restored["meta"]
    return None


def set_aside(mngr: ocp.CheckpointManager, step: int) -> Path | None:
    """Renames the damaged checkpoints/<step> to checkpoints/damaged-<step>[-n] (kept for
    inspection, no longer a step the manager lists or a later resume tries) -> the new path.
    Process 0 renames; the others return None."""
    if not is_main_process():
        return None
    directory = Path(mngr.directory)
    target, n = directory / f"damaged-{step}", 1
    while target.exists():
        n += 1
        target = directory / f"damaged-{step}-{n}"
    (directory / str(step)).rename(target)
    mngr.reload()
    return target
