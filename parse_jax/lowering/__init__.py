"""Programs lowered for TPUs and GPUs from any machine, and memory plans before allocation (docs/lowering.md)."""
