"""The model the serving and long-context benchmarks decode: GLM-5.2's attention shape at 8
layers, its layers all Full or in IndexShare groups (`PATTERNS`), tiny under --smoke."""

from __future__ import annotations

from glm_jax.config import load_config

PATTERNS = {"all Full": "FFFFFFFF", "IndexShare": "FSSSFSSS"}


def model_config(pattern: str, smoke: bool):
    """configs/glm-5.2.yaml at 8 layers of index_topk_pattern `pattern` (PATTERNS' values), 8
    routed experts and a 4,096-token vocabulary; with smoke, small widths in float32."""
    cfg = load_config("configs/glm-5.2.yaml").replace(
        num_hidden_layers=8, first_k_dense_replace=0, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=512, vocab_size=4096, num_nextn_predict_layers=0,
        index_topk_pattern=pattern)
    if smoke:
        cfg = cfg.replace(hidden_size=64, q_lora_rank=32, num_attention_heads=4, num_key_value_heads=4,
                          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, head_dim=32,
                          v_head_dim=16, moe_intermediate_size=32, index_n_heads=4, index_head_dim=16,
                          index_topk=64, dtype="float32")
    return cfg
