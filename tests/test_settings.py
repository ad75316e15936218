"""Settings are a jax-free leaf whose fields carry their help text and range, and the CLI's flags are built from them:
the same default, the same choices, the same range (a value out of it refused by the flag exactly as by the field)."""

import dataclasses
import re
import subprocess
import sys
import typing

import pytest

from parse_jax import settings
from parse_jax.cli import main
from parse_jax.cli.parser import PARSE_FLAGS, build_parser
from parse_jax.errors import ConfigError
from parse_jax.settings import Eagle3Settings, ParseConfig, SpecSettings, about, default_of
from parse_jax.train.recipe import Eagle3Spec, JudgeSpec, ModelSpec, PhaseSpec, Recipe


@pytest.mark.subprocess
def test_settings_import_no_jax_nor_anything_above_them():
    code = "import sys, parse_jax.settings; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('jax', 'jaxlib', 'numpy', 'parse_jax')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = eval(r.stdout)
    assert loaded == ["parse_jax", "parse_jax.errors", "parse_jax.settings", "parse_jax.utils",
                      "parse_jax.utils.paths", "parse_jax.utils.validation",
                      "parse_jax.utils.version"]  # the package root's __version__


@pytest.mark.subprocess
def test_the_cli_parser_and_recipes_import_no_jax():
    code = "import sys; from parse_jax.cli import build_parser; import parse_jax.train.recipe; build_parser(); " \
           "print([m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_choices_are_the_literal_types_and_verification_uses_them():
    from parse_jax.verify.scoring import POLICIES
    from parse_jax.verify.segment import SEGMENTERS

    assert settings.POLICIES == typing.get_args(settings.Policy) == ("earliest_error", "longest_valid")
    assert settings.SEGMENTERS == typing.get_args(settings.Segmenter) == ("delimiter", "stride", "hybrid")
    assert settings.ROUNDS == ("single", "multi") and settings.SUFFIX_FORMATS == ("plain", "chat")
    assert settings.MODES == typing.get_args(settings.Mode) and "parse+eagle3" in settings.MODES
    assert POLICIES is settings.POLICIES and SEGMENTERS is settings.SEGMENTERS


def test_the_embedded_tasks_format_is_the_settings_one():
    from parse_jax.tasks import DELIMITER, JUDGE_NO, JUDGE_YES, VERIFY_SUFFIX, load_task

    cfg = ParseConfig()
    assert (cfg.delimiter, cfg.judge_yes, cfg.judge_no, cfg.verify_suffix) == (DELIMITER, JUDGE_YES, JUDGE_NO,
                                                                               VERIFY_SUFFIX)
    assert load_task().VERIFY_SUFFIX == VERIFY_SUFFIX


@pytest.mark.parametrize("cls", [ParseConfig, SpecSettings, Eagle3Settings, ModelSpec, PhaseSpec, JudgeSpec,
                                 Eagle3Spec, Recipe])
def test_every_plain_field_says_why_it_exists(cls):
    for f in dataclasses.fields(cls):
        if not dataclasses.is_dataclass(f.default):  # a group of settings says it in its own fields
            assert about(cls, f.name).help, (cls.__name__, f.name)


@pytest.mark.parametrize("make, message", [
    (lambda: ParseConfig(stride=4097), "stride must be <= 4096, got 4097"),
    (lambda: ParseConfig(max_prefixes=0), "max_prefixes must be >= 1, got 0"),
    (lambda: ParseConfig(threshold=1.5), "threshold must lie in [0, 1], got 1.5"),
    (lambda: ParseConfig(policy="first"), "unknown policy 'first'; available: earliest_error, longest_valid"),
    (lambda: ParseConfig(judge_yes=1), "judge_yes must be a string, got 1"),
    (lambda: ParseConfig(judge_no=" "), "judge_no is empty or only whitespace"),
    (lambda: ParseConfig(judge_yes="Correct", judge_no="Correct"),
     "judge_yes and judge_no are the same word ('Correct')"),
    (lambda: ParseConfig.from_flat(gamma=65), "gamma must be <= 64, got 65"),
    (lambda: ParseConfig.from_flat(eagle3_tree=-1), "eagle3_tree must be >= 0, got -1"),
    (lambda: Eagle3Spec(step_decay=0.0), "EAGLE-3 training: step_decay must lie in (0, 1], got 0"),
    (lambda: JudgeSpec(real_fraction=1.0), "judge: real_fraction must lie in [0, 1), got 1"),
    (lambda: ModelSpec(num_layers=0), "model: num_layers must be >= 1, got 0"),
])
def test_fields_are_checked_against_their_metadata(make, message):
    with pytest.raises(ConfigError) as e:
        make()
    assert message in str(e.value)


def _command(name: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest: a for a in sub.choices[name]._actions}


def _refusal(make, **kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        make(**kwargs)
    return str(e.value)


def _out_of_range(cls, name):
    """Values just outside field `name`'s range (none for a choice or an unbounded side)."""
    meta, kind = about(cls, name), settings.setting_type(cls, name)
    step = 1 if kind is int else 0.5
    return [v for v in ((meta.lo - step) if meta.lo is not None else None,
                        (meta.hi + step) if meta.hi is not None else None) if v is not None]


@pytest.mark.parametrize("key", PARSE_FLAGS)
def test_each_parse_flag_has_the_fields_default_choices_and_range(key, capsys):
    cls, name = ParseConfig.flat_setting(key)
    action = _command("generate")[key]
    assert action.default is None  # unset: a --parse-config file or ParseConfig's default decides
    assert f"(default: {default_of(cls, name)})" in action.help and about(cls, name).help in action.help
    assert action.choices == settings.choices_of(cls, name)
    for bad in _out_of_range(cls, name):
        flag = "--" + key.replace("_", "-")
        expected = _refusal(ParseConfig.from_flat, **{key: bad}).replace(key, flag, 1)
        assert main(["generate", "--pair", "/nowhere", flag, str(bad), "( 1 + 2 ) :"]) == 2
        assert capsys.readouterr().err.strip() == f"parse-jax generate: error: {expected}"


def test_the_gamma_bound_of_the_cli_is_the_settings(capsys):
    assert main(["generate", "--pair", "/nowhere", "--gamma", "65", "( 1 + 2 ) :"]) == 2
    assert capsys.readouterr().err.strip() == \
        "parse-jax generate: error: --gamma must be <= 64, got 65 (allowed: 1..64)"


@pytest.mark.parametrize("name", ["steps", "batch_size", "lr", "unroll", "samples", "seed"])
def test_train_eagle3_flags_are_the_specs(name, tmp_path, capsys):
    action = _command("train-eagle3")[name]
    assert action.default == getattr(Eagle3Spec(), name) and action.help == about(Eagle3Spec, name).help
    for bad in _out_of_range(Eagle3Spec, name):
        flag = "--" + name.replace("_", "-")
        expected = _refusal(Eagle3Spec, **{name: bad}).replace(f"EAGLE-3 training: {name}", flag, 1)
        assert main(["train-eagle3", "--pair", "/nowhere", "--out", str(tmp_path / "h"), flag, str(bad)]) == 2
        assert capsys.readouterr().err.strip() == f"parse-jax train-eagle3: error: {expected}"
    assert not (tmp_path / "h").exists()


def test_train_steps_flag_has_the_phase_range(capsys):
    action = _command("train")["steps"]
    assert action.default is None and about(PhaseSpec, "steps").help in action.help
    assert main(["train", "--recipe", "pair_default", "--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "parse-jax train: error: --steps must be >= 1, got 0"


# --- ParseConfig.load / save: one reader of PARSE settings -----------------------------------------------------------

def test_load_a_shipped_name_its_file_its_json_and_a_mapping_are_one_config(tmp_path):
    import json

    from parse_jax.settings import PARSE_CONFIG_DIR

    path = PARSE_CONFIG_DIR / "qwen3_chat.yaml"
    named = ParseConfig.load("qwen3_chat")
    assert named.suffix_format == "chat" and named.delimiters == ("\n\n",) and named.max_draft_tokens == 512
    flat = {k: list(v) if isinstance(v, tuple) else v for k, v in named.flat().items()}
    assert named == ParseConfig.load(path) == ParseConfig.load(str(path)) == ParseConfig.load(json.dumps(flat))
    assert named == ParseConfig.load(flat) == ParseConfig.load(named)
    assert named != ParseConfig()  # the file's settings, not the defaults
    assert ParseConfig.load("qwen3_chat", threshold=0.25).threshold == 0.25
    for empty in ("", "  "):  # not read as the current folder
        with pytest.raises(ConfigError, match="PARSE config is empty: give a shipped name"):
            ParseConfig.load(empty)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_writes_a_file_load_reads_back_equal(tmp_path, suffix):
    cfg = ParseConfig(threshold=1e-3, delimiter=("\n\n", "."), verify_suffix=" is it right?\n", judge_yes="Yes",
                      speculation=SpecSettings(gamma=7), eagle3=Eagle3Settings(tree=3))
    out = cfg.save(tmp_path / f"pc{suffix}")
    assert out == tmp_path / f"pc{suffix}" and ParseConfig.load(out) == cfg
    assert [p.name for p in tmp_path.iterdir()] == [f"pc{suffix}"]  # no temporary left beside it
    ParseConfig(threshold=0.7).save(out)  # replaced whole
    assert ParseConfig.load(out) == ParseConfig(threshold=0.7)


@pytest.mark.parametrize("text", ["1e3", "2E5", "1e+3", "-1e3", ".5e-1"])
def test_strings_that_read_as_exponent_floats_are_saved_quoted(tmp_path, text):
    """YAML 1.2 (what load reads) takes 1e3 for a float; PyYAML's dumper, following YAML 1.1, leaves it bare."""
    cfg = ParseConfig(judge_no=text, delimiter=(text, ";"))
    assert ParseConfig.load(cfg.save(tmp_path / "pc.yaml")) == cfg


def test_load_reads_exponent_floats_as_yaml_1_2_does(tmp_path):
    f = tmp_path / "pc.yaml"
    f.write_text("threshold: 1e-1\nmax_prefixes: 3\n")
    assert ParseConfig.load(f).threshold == pytest.approx(0.1)
    args = build_parser().parse_args(["generate", "--set", "threshold=1e-1", "x"])
    from parse_jax.cli.setup import parse_config

    assert parse_config(args).threshold == pytest.approx(0.1)
    f.write_text('judge_yes: "1e-1"\n')  # quoted: a string still
    assert ParseConfig.load(f).judge_yes == "1e-1"


@pytest.mark.parametrize("text, suffix", [("threshold: 0.3\nmax_prefixes: 3\nthreshold: 0.9\n", ".yaml"),
                                          ('{"threshold": 0.3, "threshold": 0.9}', ".json")])
def test_load_refuses_a_key_given_twice_naming_it(tmp_path, text, suffix):
    f = tmp_path / f"pc{suffix}"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"key 'threshold' is given twice"):
        ParseConfig.load(f)
    if suffix == ".json":
        with pytest.raises(ConfigError, match=r"PARSE settings JSON: key 'threshold' is given twice"):
            ParseConfig.load(text)


@pytest.mark.parametrize("source, message", [
    ("no_such_config", "no such file and no shipped PARSE config of that name; shipped: qwen3_chat"),
    ("/nowhere/pc.yaml", "cannot read PARSE config /nowhere/pc.yaml"),
    ('{"threshold": 0.3', "PARSE settings JSON is not valid JSON at line 1"),
    ('{"treshold": 0.3}', "unknown PARSE setting 'treshold'"),
    ({"threshold": 7}, "PARSE settings: threshold must lie in [0, 1], got 7"),
    ({"judge_yes": True}, "judge_yes must be a string, got True"),
    ('["threshold"]', "no such file"),
    (3, "got int"),
])
def test_load_refuses_bad_sources_in_one_line(source, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ParseConfig.load(source)


def test_sweeps_segmenter_value_form_is_refused_with_the_settings_that_mean_it(capsys):
    """`sweep --values stride:4` is sweep's form; ParseConfig and `--set` say which two settings mean it."""
    with pytest.raises(ConfigError, match=r"segmenter 'stride:4' is sweep's form of a value; here set "
                                          r"segmenter='stride' and stride=4"):
        ParseConfig(segmenter="stride:4")
    assert ParseConfig(segmenter="stride", stride=4).stride == 4
    assert main(["generate", "--set", "segmenter=stride:4", "1 + 2 :"]) == 2
    assert "here set" in capsys.readouterr().err
