"""Analytic per-token costs: active parameters and forward FLOPs at a given context length.

FLOPs per generated token at context L (2 FLOPs per multiply-add):
  matmuls         2 x active parameters
  indexer         per Full layer: 2 x index_n_heads x index_head_dim x L   (q.k over all keys)
                  + index_n_heads x L for the ReLU-weighted head sum
  sparse MLA      per layer, absorbed form: 2 x heads x (2 kv_lora + rope) x min(topk, L)
"""

from __future__ import annotations

import numpy as np

from glm_jax.config import GLMConfig


def active_params(cfg: GLMConfig, parts: dict[str, int]) -> int:
    """Parameters one token touches in the decoder layers and lm_head (no embedding, no MTP)."""
    main_routed = parts["routed"] - parts["mtp_routed"]
    shared = parts["total"] - parts["routed"] - parts["embedding"] - (parts["mtp"] - parts["mtp_routed"])
    if cfg.n_routed_experts == 0:
        return shared
    return shared + main_routed * cfg.num_experts_per_tok // cfg.n_routed_experts


def indexer_flops(cfg: GLMConfig, context: int) -> int:
    return 2 * cfg.index_n_heads * cfg.index_head_dim * context + cfg.index_n_heads * context


def sparse_attention_flops(cfg: GLMConfig, context: int) -> int:
    keys = np.minimum(cfg.index_topk, context)
    return 2 * cfg.num_attention_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * keys


def flops_per_token(cfg: GLMConfig, context: int, active: int, *, index_share: bool = True) -> int:
    full = len(cfg.full_layers) if index_share else cfg.num_hidden_layers
    return (2 * active + full * indexer_flops(cfg, context)
            + cfg.num_hidden_layers * sparse_attention_flops(cfg, context))


def prefill_flops(cfg: GLMConfig, length: int, active: int) -> float:
    """Forward FLOPs of prefilling a `length`-token prompt: `flops_per_token` summed over the
    contexts 1 .. length (the pattern's Full layers run the indexer)."""
    contexts = np.arange(1, length + 1, dtype=np.float64)
    return float(np.sum(flops_per_token(cfg, contexts, active)))


def training_flops_per_token(cfg: GLMConfig, seq_len: int, active: int, *, sparse: bool = True,
                             positions=None) -> float:
    """Forward + backward FLOPs per trained token of a seq_len-token sequence (3x the forward).

    Token t attends min(topk, t + 1) keys when sparse (absorbed form), t + 1 when dense (per-head
    form) and, on Full layers, its indexer scores t + 1 keys; averaged over the positions.
    positions: int [..] the tokens' positions in their documents (packed rows, where a token
    attends only its own document); default 0 .. seq_len - 1."""
    t = np.arange(seq_len) if positions is None else np.asarray(positions).reshape(-1)
    mean_keys = float(np.mean(np.minimum(cfg.index_topk, t + 1) if sparse else t + 1))
    mean_context = float(np.mean(t + 1))
    if sparse:      # absorbed form: q'.k and p.v over the 576-wide latent rows
        attention = 2 * cfg.num_attention_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * mean_keys
    else:           # per-head q.k and p.v (the latent rows are expanded once per token: 2 x active)
        attention = 2 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * mean_keys
    indexer = 2 * cfg.index_n_heads * cfg.index_head_dim * mean_context
    forward = 2 * active + cfg.num_hidden_layers * attention + len(cfg.full_layers) * indexer
    return 3.0 * forward
