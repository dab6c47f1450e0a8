"""Training: losses, the jitted train step and checkpointing of the full training state."""
