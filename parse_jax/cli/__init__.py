"""The `parse-jax` command line (`parse_jax.cli:main`): the parser in parser.py, what a command builds from its flags
in setup.py, the commands in commands.py."""

from parse_jax.cli.main import main
from parse_jax.cli.parser import build_parser

__all__ = ["build_parser", "main"]
