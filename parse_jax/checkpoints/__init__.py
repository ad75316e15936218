"""Model files in and out: Hugging Face folders (hf), parse-jax Orbax checkpoints (orbax), training runs as Orbax
CheckpointManager folders (runs), the embedded pair (pair), and the one loader `load_model(path, mesh=)` (load)."""
