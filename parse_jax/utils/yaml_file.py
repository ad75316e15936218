"""The YAML of parse-jax's settings files and `--set` values: PyYAML's safe loader with two changes, so that a
file means what it says.

- Numbers with an exponent are floats as YAML 1.2 reads them (`1e-1`, `5E3`, `-2.5e+2`); PyYAML follows YAML 1.1,
  which wants a dot and a signed exponent and reads `1e-1` as the string "1e-1".
- A key given twice in one mapping is an error naming the key and its line (PyYAML keeps the last one, silently).

`write_yaml` writes what `read_yaml` reads back equal (it quotes the strings that the first change would read as
floats).

Errors are one line (ConfigError) naming `where`: the file, the flag or the text it came from. Nothing here imports
jax; PyYAML is imported when a text is read.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from parse_jax.errors import ConfigError

# YAML 1.2's float with an exponent (the ones YAML 1.1 misses); PyYAML's own float resolver still reads the rest.
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


@functools.cache
def _loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader, exponent floats read as YAML 1.2 reads them, duplicate keys refused."""

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                self.flatten_mapping(node)  # merge keys (<<) first, as SafeLoader does
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        if key in seen:
                            raise _Duplicate(key, seen[key], line)
                        seen[key] = line
                    except TypeError:
                        continue  # an unhashable key: PyYAML's own error follows
            return super().construct_mapping(node, deep=deep)

    # add_implicit_resolver copies the resolver table onto the subclass: SafeLoader itself is left as it is
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789."))
    return Loader


class _Duplicate(Exception):
    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(key, first, again)
        self.key, self.first, self.again = key, first, again


def read_yaml(text: str, where: str) -> Any:
    """The value of YAML `text` (from `where`, named in errors): a ConfigError for invalid YAML (with the line and
    column) and for a key given twice in one mapping."""
    import yaml

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
    except _Duplicate as e:
        lines = f"line {e.first}" if e.first == e.again else f"lines {e.first} and {e.again}"
        raise ConfigError(f"{where}: key {e.key!r} is given twice ({lines}); give each setting once") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None


def write_yaml(data: Any) -> str:
    """`data` as YAML that `read_yaml` reads back equal: PyYAML's safe dumper, except that a string YAML 1.2 reads
    as a float (`1e3`: PyYAML, following YAML 1.1, leaves it unquoted) is quoted."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> Any:
        style = "'" if _EXP_FLOAT.match(value) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, allow_unicode=True)


def read_yaml_scalar(text: str) -> Any:
    """One `--set KEY=VALUE` value read as a YAML scalar (`0.3`, `1e-1`, `true`, `"\\n\\n"`); text that is not valid
    YAML is itself."""
    if not text.strip():
        return text
    try:
        return read_yaml(text, "value")
    except ConfigError:
        return text


def read_json(text: str, where: str) -> Any:
    """The value of JSON `text`: a ConfigError for invalid JSON (with the line and column) and for a key given twice
    in one object."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ConfigError(f"{where}: key {key!r} is given twice; give each setting once")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
