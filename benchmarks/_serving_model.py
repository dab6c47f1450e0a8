"""The model the serving and long-context benchmarks decode: GLM-5.2's attention shape at 8
layers, its layers all Full or in IndexShare groups (`PATTERNS`), tiny under --smoke."""

from __future__ import annotations

from glm_jax.config import load_config

PATTERNS = {"all Full": "FFFFFFFF", "IndexShare": "FSSSFSSS"}


def model_config(pattern: str, smoke: bool, config: str | None = None):
    """configs/glm-5.2.yaml at 8 layers of index_topk_pattern `pattern` (PATTERNS' values), 8
    routed experts and a 4,096-token vocabulary; or the 8-layer model of the config file
    `config` (e.g. configs/small-128k.yaml) with that pattern. With smoke, small widths in
    float32 (kv_lora 128: the FP8 cache layout's scale group)."""
    if config is None:
        cfg = load_config("configs/glm-5.2.yaml").replace(
            num_hidden_layers=8, first_k_dense_replace=0, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=512, vocab_size=4096, num_nextn_predict_layers=0, index_topk_pattern=pattern)
    else:
        cfg = load_config(config)
        if cfg.num_hidden_layers != len(pattern):
            raise ValueError(f"--config {config}: {cfg.num_hidden_layers} layers; the patterns need {len(pattern)}")
        cfg = cfg.replace(index_topk_pattern=pattern)
    if smoke:
        cfg = cfg.replace(hidden_size=64, q_lora_rank=32, num_attention_heads=4, num_key_value_heads=4,
                          kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=16, head_dim=32,
                          v_head_dim=16, moe_intermediate_size=32, index_n_heads=4, index_head_dim=16,
                          index_topk=64, dtype="float32")
    return cfg
