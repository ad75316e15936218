"""Errors users see. Each names the problem; none is a traceback from deep inside jax."""


class ParseJaxError(ValueError):
    """Base of every error parse-jax raises on bad input."""


class ConfigError(ParseJaxError):
    """A config (model, engine, recipe) that cannot be used as given."""


class CheckpointError(ParseJaxError):
    """A model folder or checkpoint that is missing, corrupt or does not match its config."""


class InputError(ParseJaxError):
    """A request that cannot be served: empty prompt, prompt longer than the cache, bad ids."""
