"""Measurement: `parse-jax bench` (bench), sweeps and calibration (sweep), plots, evaluation on data sets (eval/),
and what they share (runs: modes, runners, `measure`; provenance)."""
