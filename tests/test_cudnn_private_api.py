"""The one use of JAX's private modules (`pallas_kernels/causal_attention/cudnn.py`: cuDNN's packed
attention) is where that module expects it, and its fallback works when it is not.

These run on the CPU: a JAX release that moves or renames the private function, one of its
parameters or its mask type fails `test_private_cudnn_api_is_where_we_use_it` here, before a
GPU run would quietly take the fallback.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_contract import packed_documents
from pallas_kernels.causal_attention import cudnn, reference


@pytest.fixture
def fresh_guard():
    """packed_attention's cached answer cleared before and after (it warns once per process)."""
    cudnn.packed_attention.cache_clear()
    yield
    cudnn.packed_attention.cache_clear()


def test_private_cudnn_api_is_where_we_use_it(fresh_guard):
    fn, mask_type = cudnn.private_api()
    assert mask_type.name == "PADDING_CAUSAL" and callable(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cudnn.packed_attention() is not None


@pytest.mark.parametrize("moved,named", [
    (dict(PRIVATE_MODULE="jax._src.cudnn.no_such_module"), "cannot be imported"),
    (dict(PRIVATE_FUNCTION="no_such_function"), "has no function no_such_function"),
    (dict(PRIVATE_PARAMETERS=cudnn.PRIVATE_PARAMETERS + ("segment_offsets",)), "has no parameter segment_offsets"),
    (dict(PRIVATE_MASK_TYPE=("MaskType", "PACKED_CAUSAL")), "has no MaskType.PACKED_CAUSAL"),
])
def test_a_moved_private_api_warns_once_and_falls_back(fresh_guard, monkeypatch, moved, named):
    for name, value in moved.items():
        monkeypatch.setattr(cudnn, name, value)
    with pytest.raises(cudnn.PrivateApiMoved, match=named):
        cudnn.private_api()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cudnn.packed_attention() is None
        assert cudnn.packed_attention() is None
    assert len(caught) == 1 and named in str(caught[0].message)
    assert "[S, S] document mask" in str(caught[0].message)


def test_the_fallback_mask_of_segments_is_the_documents_mask():
    """Without the packed kernel, packed rows attend through the mask built from segments
    (`causal_attention.reference.segment_mask`): the same-document pairs, each token in its segment."""
    rng = np.random.default_rng(4)
    mask, (offsets, lengths) = packed_documents(rng, 3, 10)
    got = reference.segment_mask(offsets, lengths, 10)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(mask))
    # a token past the listed segments (the table's bound too small) sees nothing
    short = reference.segment_mask(offsets[:, :2].at[:, 1].set(-1), lengths[:, :1], 10)
    inside = np.arange(10)[None, :] < np.asarray(lengths[:, :1])
    np.testing.assert_array_equal(np.asarray(jnp.any(short, axis=-1)), inside)
