"""`glm_jax.ops.KernelChoice`: a frozen, hashable mapping op -> OpChoice(impl, config) with the
settings of the whole choice, and every `ops` function reading its own op's entry."""

from __future__ import annotations

import pickle

import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from glm_jax import ops
from glm_jax.ops import KernelChoice, OpChoice


def test_ops_left_out_take_their_defaults():
    choice = KernelChoice()
    assert list(choice) == list(ops.OPS) and len(choice) == 5
    assert dict(choice) == {"sparse_mla": ("auto", None), "indexer_topk": ("auto", None),
                            "indexer_cross_entropy": ("auto", None), "causal_attention": ("auto", None),
                            "dense_indexer_kl": ("xla", None)}
    assert (choice.interpret, choice.batch_invariant, choice.invariant_rows, choice.token_rows) == (False, False,
                                                                                                      None, None)


def test_an_entry_is_an_impl_name_a_pair_or_an_op_choice():
    config = pk.XlaConfig(q_chunk=8)
    choices = [KernelChoice(sparse_mla=("xla", config)), KernelChoice(sparse_mla=OpChoice("xla", config)),
               KernelChoice().replace(sparse_mla=("xla", config))]
    assert all(c == choices[0] and hash(c) == hash(choices[0]) for c in choices)
    assert choices[0]["sparse_mla"] == OpChoice("xla", config) and choices[0]["sparse_mla"].impl == "xla"
    assert KernelChoice(sparse_mla="xla") != choices[0] and KernelChoice(sparse_mla="xla")["sparse_mla"].config is None
    assert KernelChoice(dense_indexer_kl="xla") == KernelChoice()          # the default, written out
    assert repr(choices[0]) == "KernelChoice(sparse_mla=OpChoice(impl='xla', config=XlaConfig(q_chunk=8)))"


def test_it_is_frozen_hashable_and_picklable():
    choice = KernelChoice(indexer_topk="reference", interpret=True, batch_invariant=True, invariant_rows=4)
    with pytest.raises(AttributeError, match="KernelChoice is frozen"):
        choice.interpret = False
    assert {choice: 1}[KernelChoice(indexer_topk="reference", interpret=True, batch_invariant=True,
                                    invariant_rows=4)] == 1
    assert pickle.loads(pickle.dumps(choice)) == choice
    assert choice.replace(interpret=False).interpret is False and choice.interpret is True
    assert choice.token_rows == 4


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(attention="xla"), ValueError, "KernelChoice: unknown op 'attention'; the ops are sparse_mla, indexer_topk, "
                                        "indexer_cross_entropy, causal_attention, dense_indexer_kl"),
    (dict(sparse_mla="flash"), ValueError, "KernelChoice sparse_mla='flash': valid choices are 'auto', 'reference'"),
    (dict(causal_attention="pallas_gpu"), ValueError, "KernelChoice causal_attention='pallas_gpu': valid choices"),
    (dict(indexer_topk=("xla", pk.SparseMLAGpuConfig())), ValueError,
     "KernelChoice indexer_topk='xla' takes config=XlaConfig(...), got SparseMLAGpuConfig"),
    (dict(interpret=1), TypeError, "KernelChoice.interpret must be True or False, got 1"),
    (dict(invariant_rows=0), ValueError, "KernelChoice.invariant_rows must be a positive int or None, got 0"),
])
def test_what_it_does_not_take_is_one_line(kwargs, error, message):
    with pytest.raises(error, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as info:
        KernelChoice(**kwargs)
    assert "\n" not in str(info.value)


def test_an_unknown_op_is_a_key_error():
    with pytest.raises(KeyError, match="unknown op 'indexer'"):
        KernelChoice()["indexer"]
    assert "indexer" not in KernelChoice() and "sparse_mla" in KernelChoice()


B, S, T, H, D, K = 1, 2, 4, 2, 8, 2

CALLS = {   # ops function -> (the pallas_kernels function it runs, the KernelChoice entry it reads, its arguments)
    "indexer_scores": ("indexer_scores", "indexer_topk",
                       lambda: ((jnp.ones((B, S, H, D)), jnp.ones((B, T, D)), jnp.ones((B, S, H))),
                                dict(q_pos=jnp.ones((B, S), jnp.int32), kv_len=jnp.full((B,), T, jnp.int32)))),
    "indexer_topk": ("indexer_topk", "indexer_topk",
                     lambda: ((jnp.ones((B, S, H, D)), jnp.ones((B, T, D)), jnp.ones((B, S, H))),
                              dict(topk=K, q_pos=jnp.ones((B, S), jnp.int32), kv_len=jnp.full((B,), T, jnp.int32)))),
    "paged_indexer_topk": ("paged_indexer_topk", "indexer_topk",
                           lambda: ((jnp.ones((B, S, H, D)), jnp.ones((1, 2, 2, D)), jnp.zeros((B, 2), jnp.int32),
                                     jnp.ones((B, S, H))),
                                    dict(topk=K, q_pos=jnp.ones((B, S), jnp.int32), kv_len=jnp.full((B,), T, jnp.int32)))),
    "sparse_mla": ("sparse_mla", "sparse_mla",
                   lambda: ((jnp.ones((B, S, H, D)), jnp.ones((B, T, D)), jnp.zeros((B, S, K), jnp.int32)),
                            dict(sm_scale=0.5, v_dim=4))),
    "paged_sparse_mla": ("paged_sparse_mla", "sparse_mla",
                         lambda: ((jnp.ones((B, S, H, D)), jnp.ones((1, 2, 2, D)), jnp.zeros((B, 2), jnp.int32),
                                   jnp.zeros((B, S, K), jnp.int32)), dict(sm_scale=0.5, v_dim=4))),
    "sparse_mla_backward_index": ("sparse_mla_backward_index", "sparse_mla",
                                  lambda: ((jnp.zeros((B, S, K), jnp.int32), T), dict(dk=D, dtype=jnp.float32))),
    "indexer_cross_entropy": ("indexer_cross_entropy", "indexer_cross_entropy",
                              lambda: ((jnp.ones((B, S, H, D)), jnp.ones((B, T, D)), jnp.ones((B, S, H)),
                                        jnp.zeros((B, S, K), jnp.int32), jnp.ones((B, S, K))), {})),
    "causal_attention": ("causal_attention", "causal_attention",
                         lambda: ((jnp.ones((B, S, H, D)),) * 3, dict(scale=0.5))),
    "dense_indexer_kl": ("dense_indexer_kl", "dense_indexer_kl",
                         lambda: (([jnp.ones((B, S, H, D))], [jnp.ones((B, S, D))], jnp.ones((B, S, H, D)),
                                   jnp.ones((B, S, D)), jnp.ones((B, S, H))),
                                  dict(sm_scale=0.5, kv_len=jnp.full((B,), S, jnp.int32)))),
}


@pytest.mark.parametrize("name", CALLS)
def test_each_op_reads_its_own_entry(name, monkeypatch):
    """Every ops function takes `kernels` and passes its own op's impl and config, and the
    choice's interpret, to the kernel; the other ops' entries do not reach it."""
    kernel, op, inputs = CALLS[name]
    seen = []
    monkeypatch.setattr(pk, kernel, lambda *a, **k: seen.append(k) or (jnp.zeros(()),) * 2)
    entries = {o: ("reference", pk.NoConfig()) for o in ops.OPS}
    entries[op] = ("xla", ops.config_type(op, "xla")())
    args, kwargs = inputs()
    getattr(ops, name)(*args, **kwargs, kernels=KernelChoice(**entries, interpret=True))
    assert [(k["impl"], k["config"], k["interpret"]) for k in seen] == [("xla", entries[op][1], True)]
