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
    assert messages and messages[0].startswith("checkpoint 2 cannot be restored: ")
    assert "bound method" not in messages[0] and "\n" not in messages[0]
    # set aside, so that the next resume neither retries nor reports it
    assert (tmp_path / "checkpoints" / "damaged-2").is_dir()
    again = []
    assert checkpointing.restore_latest(checkpointing.manager(tmp_path), {"w": jnp.zeros((4,))},
                                        log=again.append)[0] == 1
    assert again == []


def test_truncated_array_is_named():
    from glm_jax.checkpoint_damage import damage_summary

    cause = ValueError('OUT_OF_RANGE: Error reading "lm_head.kernel/0.0" in OCDBT database: Requested byte '
                       'range [0, 1638499) is not valid for value of size 1000')
    try:
        try:
            raise cause
        except ValueError as e:
            raise Exception("Encountered error while reading array index: <bound method x of y>") from e
    except Exception as outer:
        assert damage_summary(outer) == ("array 'lm_head.kernel' cannot be read: its data file is truncated "
                                         "(shorter than when it was written)")


def test_a_run_that_has_not_exported_says_how_to_get_weights(tmp_path):
    import pytest

    from glm_jax.checkpoint import load_model_dir

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"has not exported its weights yet .* scripts/export_checkpoint.py "
                                                 r".* train.py --resume"):
        load_model_dir(tmp_path)
