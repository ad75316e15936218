"""Recipes: typed YAML validation, unknown names and keys are clear errors; the CLI prints one line, exit 2."""

import pytest

from parse_jax.cli import main
from parse_jax.errors import ConfigError
from parse_jax.train.recipe import Recipe, known_recipes, load_recipe, recipe_from_dict


def test_the_shipped_recipe_loads():
    assert "pair_default" in known_recipes()
    r = load_recipe("pair_default")
    assert isinstance(r, Recipe) and r.target_model.num_layers > r.draft_model.num_layers


def test_unknown_recipe_name():
    with pytest.raises(ConfigError, match="unknown recipe 'nope'.*pair_default") as e:
        load_recipe("nope")
    assert "mesh_" not in str(e.value)  # the mesh configs beside the recipes are not recipes


@pytest.mark.parametrize("d, msg", [
    ({"draft": {"stepz": 3}}, r"unknown key\(s\) \['stepz'\] in recipe x.draft"),
    ({"extra": 1}, r"unknown key\(s\) \['extra'\]"),
    ({"draft": {"steps": "ten"}}, "draft.steps must be an integer"),
    ({"task": "impossible"}, "unknown task"),
    ({"target_model": {"hidden_size": 30, "num_heads": 4}}, "hidden_size"),
    ({"judge": {"error_fraction": 1.5}}, "judge.error_fraction"),
    ({"draft": 3}, "must be a mapping"),
    # the ranges of the fields' metadata, with the key's path in the recipe
    ({"draft": {"lr": 0}}, r"recipe x.draft.lr must lie in \(0, inf\), got 0"),
    ({"judge": {"real_fraction": 1.0}}, r"recipe x.judge.real_fraction must lie in \[0, 1\), got 1"),
    ({"draft_model": {"num_layers": 0}}, "recipe x.draft_model.num_layers must be >= 1, got 0"),
    ({"seq_len": 4}, "recipe x.seq_len must be >= 8, got 4"),
    ({"grow": {"enabled": "yes"}}, "recipe x.grow.enabled must be true or false"),
    ({"target": {"seed": -1}}, "recipe x.target.seed must be >= 0, got -1"),
])
def test_bad_recipes_are_clear_errors(d, msg):
    with pytest.raises(ConfigError, match=msg):
        recipe_from_dict(d, name="x")


def test_cli_unknown_recipe_is_one_line_exit_2(capsys):
    assert main(["train", "--recipe", "no_such_recipe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parse-jax train: error: unknown recipe") and "\n" not in err


def test_cli_bad_yaml_file(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text("draft: {steps: 3, lr: [1]}\n")
    assert main(["train", "--recipe", str(p)]) == 2
    assert "draft.lr must be a number" in capsys.readouterr().err
