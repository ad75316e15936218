"""Helpers every layer may use and none depends on: input checks (validation), atomic result files, progress and
logging, the persistent compile cache. No module here imports jax at import time."""
