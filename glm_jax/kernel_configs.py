"""Kernel configs from a run's settings: `{"attention": {"block_k": 64}}` (the command line's
`--kernel-config attention.block_k=64`) -> the config dataclass of the implementation that each
op runs (`ops.config_type`, from the pallas_kernels registry), set in a `glm_jax.ops.KernelChoice`.

A group is an op's name (`ops.OPS`: sparse_mla, indexer_topk, ...) or the older spelling that
run directories and command lines carry (`GROUP_ALIASES`: attention, indexer, indexer_kl,
dense_kl). The fields are those of the config dataclass itself (whatever it holds today); a
name it does not have is refused naming the class and its fields, and a value the config
refuses (its own checks) is refused with its message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from glm_jax.ops import OPS, KernelChoice, OpChoice, config_type, resolve_impl

#: The group names of settings written before the groups were the ops' names -> the op.
GROUP_ALIASES = {"attention": "sparse_mla", "indexer": "indexer_topk", "indexer_kl": "indexer_cross_entropy",
                 "dense_kl": "dense_indexer_kl"}


def group_op(group: str) -> str:
    """The op a kernel config group names (an op, or a `GROUP_ALIASES` spelling); ValueError
    for another name."""
    op = GROUP_ALIASES.get(group, group)
    if op not in OPS:
        raise ValueError(f"kernel config {group!r}: no such kernel group (groups: the ops {', '.join(OPS)}, "
                         f"or {', '.join(GROUP_ALIASES)})")
    return op


def configured(choice: KernelChoice, configs: Mapping[str, Mapping[str, Any]]) -> KernelChoice:
    """`choice` with each group of `configs` set to its implementation's config (an "auto"
    implementation resolved for this backend first, so that config and implementation agree).
    Raises ValueError for a group, a field or a value the kernels do not have."""
    for group, fields in configs.items():
        op = group_op(group)
        if not isinstance(fields, Mapping):
            raise ValueError(f"kernel config {group}: expected a mapping of fields, got {fields!r}")
        impl = resolve_impl(op, choice[op].impl)
        cls = config_type(op, impl)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ValueError(f"kernel config {group}.{unknown[0]}: {cls.__name__} (the {impl!r} {op} kernel) has no "
                             f"such field; its fields: {', '.join(known) or 'none'}")
        try:
            config = cls(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"kernel config {group}: {e}") from None
        choice = choice.replace(**{op: OpChoice(impl, config)})
    return choice
