"""Hugging Face safetensors checkpoints (`glm_moe_dsa`, `deepseek_v32`) <-> GLMModel.

    from glm_jax.convert import load_hf_checkpoint, export_hf_checkpoint
    model = load_hf_checkpoint("GLM-5.2-FP8/", mesh=mesh)        # streamed, dequantised, sharded
    export_hf_checkpoint(model, "out/", num_shards=8)            # bf16 safetensors + index json
"""

from glm_jax.convert.check import CheckpointConversionError
from glm_jax.convert.export import export_hf_checkpoint
from glm_jax.convert.load import default_mesh_sharding, load_hf_checkpoint

__all__ = ["CheckpointConversionError", "default_mesh_sharding", "export_hf_checkpoint", "load_hf_checkpoint"]
