"""Kernel configs set from the front ends (glm_jax.kernel_configs, --kernel-config): checked
against the config dataclass of the implementation each group runs, and recorded with the run."""

from __future__ import annotations

import argparse

import pytest

import train
from glm_jax import ops, settings
from glm_jax.frontends import cli
from glm_jax.kernel_configs import configured
from glm_jax.training import run_config
from glm_jax.training.run_config import KernelsConfig
from glm_jax.training.step import StepConfig
from pallas_kernels import XlaConfig


def test_a_field_of_the_implementations_config_is_set():
    choice = configured(ops.KernelChoice(sparse_mla="xla"), {"attention": {"q_chunk": 64}})
    assert choice["sparse_mla"] == ("xla", XlaConfig(q_chunk=64))
    assert choice["indexer_topk"] == ("auto", None)


@pytest.mark.parametrize("group,op", [("attention", "sparse_mla"), ("sparse_mla", "sparse_mla"),
                                      ("indexer", "indexer_topk"), ("indexer_topk", "indexer_topk"),
                                      ("indexer_kl", "indexer_cross_entropy"), ("dense_kl", "dense_indexer_kl"),
                                      ("dense_indexer_kl", "dense_indexer_kl")])
def test_a_group_is_an_op_or_its_older_spelling(group, op):
    """Run directories written before the groups were named after the ops keep loading."""
    choice = configured(ops.KernelChoice(**{op: "xla"}), {group: {}})
    assert choice[op] == ("xla", ops.config_type(op, "xla")())
    assert [o for o in ops.OPS if choice[o].config is not None] == [op]


def test_auto_is_resolved_so_that_config_and_implementation_agree():
    choice = configured(ops.KernelChoice(indexer_topk="auto"), {"indexer": {"q_chunk": 8}})
    assert choice["indexer_topk"] == ("xla", XlaConfig(q_chunk=8))     # on a CPU


@pytest.mark.parametrize("configs,message", [
    ({"attention": {"block_kk": 64}}, "kernel config attention.block_kk: XlaConfig (the 'xla' sparse_mla kernel) has "
                                      "no such field; its fields: q_chunk"),
    ({"attn": {"q_chunk": 64}}, "kernel config 'attn': no such kernel group (groups: the ops sparse_mla, indexer_topk, "
                                "indexer_cross_entropy, causal_attention, dense_indexer_kl, or attention, indexer, "
                                "indexer_kl, dense_kl)"),
    ({"attention": {"q_chunk": -1}}, "kernel config attention: XlaConfig.q_chunk must be a positive int"),
    ({"attention": 5}, "kernel config attention: expected a mapping of fields, got 5"),
])
def test_what_the_kernels_do_not_take_is_refused(configs, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        configured(ops.KernelChoice(sparse_mla="xla"), configs)


def test_flags_over_the_file_and_recorded_with_the_run(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("out: r\nkernels:\n  attention_impl: xla\n  kernel_config:\n    attention: {q_chunk: 32}\n"
                    "    indexer: {q_chunk: 16}\n")
    got = train.train_config(train.parse_args(["--run-config", str(path), "--kernel-config", "attention.q_chunk=64"]))
    assert got.kernels.kernel_config == {"attention": {"q_chunk": 64}, "indexer": {"q_chunk": 16}}
    run_config.save(got, tmp_path)
    assert run_config.load(tmp_path / run_config.FILE_NAME).kernels == got.kernels
    assert StepConfig.of(got).forward.kernels["sparse_mla"] == ("xla", XlaConfig(q_chunk=64))


def test_a_changed_kernel_config_is_named_on_resume():
    old = KernelsConfig()
    new = KernelsConfig(kernel_config={"attention": {"block_k": 64}})
    assert [str(c) for c in settings.differences(old, new)] == \
        ["kernels.kernel_config (--kernel-config) {} -> {'attention': {'block_k': 64}}"]


@pytest.mark.parametrize("item", ["attention.block_k", "block_k=64", ".block_k=64"])
def test_a_malformed_item_is_one_line(item):
    with pytest.raises(cli.UserError, match="expected GROUP.FIELD=VALUE"):
        cli.kernel_config([item])


def test_the_help_example_is_accepted_on_a_cpu():
    """--kernel-config's example in --help sets a field of what auto runs here (the xla kernel on a CPU)."""
    import jax

    assert jax.default_backend() == "cpu"
    ap = argparse.ArgumentParser()
    cli.add_kernel_flags(ap)
    assert f"e.g. {cli.KERNEL_CONFIG_EXAMPLE} " in " ".join(ap.format_help().split())
    choice = configured(ops.KernelChoice(), cli.kernel_config([cli.KERNEL_CONFIG_EXAMPLE]))
    assert choice["sparse_mla"].impl == "xla" and choice["sparse_mla"].config.q_chunk == 64
