import jax.numpy as jnp
import numpy as np

from glm_jax.training import checkpointing


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
    mngr = checkpointing.manager(tmp_path, keep=3)
    for step in (1, 2):
        checkpointing.save(mngr, step, {"w": jnp.full((4,), float(step))}, {"step": step})
    mngr.wait_until_finished()
    # damage every data file of the newest checkpoint
    for f in (tmp_path / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file() and f.name not in ("_CHECKPOINT_METADATA",):
            f.write_bytes(b"garbage")
    messages = []
    step, state, meta = checkpointing.restore_latest(checkpointing.manager(tmp_path), {"w": jnp.zeros((4,))},
                                                     log=messages.append)
    assert step == 1 and meta == {"step": 1}
    np.testing.assert_array_equal(state["w"], np.ones(4))
    assert messages and "checkpoint 2" in messages[0]
