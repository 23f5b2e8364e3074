"""The trainer: launch, loop, AMP, metrics, checkpoints. Free of algorithm-specific branches."""
