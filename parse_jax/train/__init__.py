"""Training the embedded draft/target pair: recipes (configs/*.yaml), padded batches, an optax trainer with
resumable Orbax checkpoints, the draft -> samples -> target pipeline, and the quality measures (evaluate)."""

from parse_jax.train.recipe import Recipe, load_recipe

__all__ = ["Recipe", "load_recipe", "run_recipe"]


def __getattr__(name: str):
    """`run_recipe` on first use: the pipeline imports jax, the recipes (which the CLI's parser reads) do not."""
    if name == "run_recipe":
        from parse_jax.train.pipeline import run_recipe

        return run_recipe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
