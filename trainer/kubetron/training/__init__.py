"""The training half: model, loop, checkpoints (imports torch and megatron-core)."""
