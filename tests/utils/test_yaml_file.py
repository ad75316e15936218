"""The YAML of settings files: exponent floats as YAML 1.2 reads them, duplicate keys refused, one-line errors."""

import pytest
import yaml

from parse_jax.errors import ConfigError
from parse_jax.utils.yaml_file import read_json, read_yaml, read_yaml_scalar


def test_exponent_numbers_are_floats_and_the_rest_reads_as_pyyaml_reads_it():
    text = "a: 1e-1\nb: 5E3\nc: -2.5e+2\nd: 1.5\ne: 10\nf: .5\ng: '1e-1'\nh: true\ni: 1e\nj: [1, 2]\n"
    got = read_yaml(text, "t")
    assert got == {"a": 0.1, "b": 5000.0, "c": -250.0, "d": 1.5, "e": 10, "f": 0.5, "g": "1e-1", "h": True,
                   "i": "1e", "j": [1, 2]}
    assert yaml.safe_load("a: 1e-1") == {"a": "1e-1"}  # PyYAML's own loader is left as it was
    assert read_yaml_scalar("1e-1") == 0.1 and read_yaml_scalar('"\\n"') == "\n" and read_yaml_scalar("a: b: c") == \
        "a: b: c" and read_yaml_scalar(" ") == " "


@pytest.mark.parametrize("text, lines", [("a: 1\nb: 2\na: 3\n", "lines 1 and 3"), ("{a: 1, a: 2}", "line 1"),
                                         ("x:\n  a: 1\n  a: 1\n", "lines 2 and 3")])
def test_a_key_given_twice_is_refused_naming_the_key_and_lines(text, lines):
    with pytest.raises(ConfigError, match=f"f.yaml: key 'a' is given twice \\({lines}\\)"):
        read_yaml(text, "f.yaml")


def test_invalid_yaml_and_json_name_the_place():
    with pytest.raises(ConfigError, match=r"f.yaml is not valid YAML at line 2, column"):
        read_yaml("a: 1\n b: [\n", "f.yaml")
    with pytest.raises(ConfigError, match=r"j is not valid JSON at line 1, column 9"):
        read_json('{"a": 1,', "j")
    with pytest.raises(ConfigError, match=r"j: key 'a' is given twice"):
        read_json('{"a": 1, "a": 2}', "j")
    assert read_yaml("a: &x {b: 1}\nc:\n  <<: *x\n  d: 2\n", "m") == {"a": {"b": 1}, "c": {"b": 1, "d": 2}}
