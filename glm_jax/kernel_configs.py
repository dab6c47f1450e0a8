"""Kernel configs from a run's settings: `{"attention": {"block_k": 64}}` (the command line's
`--kernel-config attention.block_k=64`) -> the config dataclass of the implementation that each
kernel group runs (`pallas_kernels.registry`), set in a `glm_jax.ops.KernelChoice`.

The fields are those of the config dataclass itself (whatever it holds today); a name it does
not have is refused naming the class and its fields, and a value the config refuses (its own
checks) is refused with its message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pallas_kernels import registry
from glm_jax.ops import KernelChoice

#: The kernel groups a config may name -> (KernelChoice's implementation field, its config field,
#: the registry op whose implementations that field names).
GROUPS = {"attention": ("attention", "attention_config", "sparse_mla"),
          "indexer": ("indexer", "indexer_config", "indexer_topk"),
          "indexer_kl": ("indexer_kl", "indexer_kl_config", "indexer_cross_entropy"),
          "dense_kl": ("dense_kl", "dense_kl_config", "dense_indexer_kl")}


def configured(choice: KernelChoice, configs: Mapping[str, Mapping[str, Any]]) -> KernelChoice:
    """`choice` with each group of `configs` set to its implementation's config (an "auto"
    implementation resolved for this backend first, so that config and implementation agree).
    Raises ValueError for a group, a field or a value the kernels do not have."""
    for group, fields in configs.items():
        if group not in GROUPS:
            raise ValueError(f"kernel config {group!r}: no such kernel group (groups: {', '.join(GROUPS)})")
        if not isinstance(fields, Mapping):
            raise ValueError(f"kernel config {group}: expected a mapping of fields, got {fields!r}")
        impl_field, config_field, op = GROUPS[group]
        impl = registry.resolve_impl(op, getattr(choice, impl_field))
        cls = registry.REGISTRY[op][impl].config
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ValueError(f"kernel config {group}.{unknown[0]}: {cls.__name__} (the {impl!r} {op} kernel) has no "
                             f"such field; its fields: {', '.join(known) or 'none'}")
        try:
            config = cls(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"kernel config {group}: {e}") from None
        choice = dataclasses.replace(choice, **{impl_field: impl, config_field: config})
    return choice
