"""Typed settings of the engine: PARSE's own (`ParseConfig`), token-level speculation's (`SpecSettings`) and
EAGLE-3's (`Eagle3Settings`), each validated where it is built (parse_jax.utils.validation), choices as Literal types.

Each field says why it exists and what range it takes in its metadata (`setting(...)`); `__post_init__` checks the
field against it and the CLI builds its flags (type, choices, help, default, range) from it, so neither keeps a copy.
Nothing here imports jax (nor anything but the standard library, parse_jax.errors and parse_jax.utils; PyYAML when a
YAML text is read or written).

Config files and the CLI name every setting flat (`gamma`, `eagle3_gamma`, `eagle3_tree`, `eagle3_tree_top_k`,
`eagle3_tree_width` beside PARSE's): `ParseConfig.from_flat` and `ParseConfig.flat_fields` map those names onto the
groups.
`ParseConfig.load` is the one reader of PARSE settings (a shipped name, a YAML or JSON file, a JSON string, a
mapping; the CLI's --parse-config and --set go through it too), `ParseConfig.save` writes one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from parse_jax.errors import ConfigError, ParseJaxError
from parse_jax.utils.paths import config_dir
from parse_jax.utils.validation import check_choice, check_float, check_int

Policy = Literal["earliest_error", "longest_valid"]
Rounds = Literal["single", "multi"]
RoundsSetting = Literal["auto", "single", "multi"]  # "auto": the schedule chooses per batch (docs/design.md §7)
SuffixFormat = Literal["plain", "chat"]
Segmenter = Literal["delimiter", "stride", "hybrid"]
PrefixChoice = Literal["spread", "confidence", "auto"]  # which step ends a pass verifies (docs/design.md §2)
Mode = Literal["target", "sd", "sequential", "parse", "eagle3", "parse+eagle3"]
Schedule = Literal["fixed", "auto"]
Batching = Literal["continuous", "fixed"]  # how bench, sweep, calibrate and eval batch their prompts
POLICIES: tuple[str, ...] = typing.get_args(Policy)
ROUNDS: tuple[str, ...] = typing.get_args(Rounds)
ROUNDS_SETTINGS: tuple[str, ...] = typing.get_args(RoundsSetting)
SUFFIX_FORMATS: tuple[str, ...] = typing.get_args(SuffixFormat)
SEGMENTERS: tuple[str, ...] = typing.get_args(Segmenter)
MODES: tuple[str, ...] = typing.get_args(Mode)
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)
BATCHING: tuple[str, ...] = typing.get_args(Batching)
DEFAULT_BATCHING: Batching = "continuous"

# The embedded task's verification format (parse_jax.tasks writes its texts and vocabulary with these), which
# ParseConfig's defaults fit: a row is the problem, the steps so far (each closed by DELIMITER), VERIFY_SUFFIX, then
# one judge word.
DELIMITER = ";"
VERIFY_SUFFIX = " | check"
JUDGE_YES = "Correct"
JUDGE_NO = "Incorrect"


# --- field metadata: the one copy of each setting's help text and range -------------------------------------------

@dataclasses.dataclass(frozen=True)
class About:
    """What a setting field's metadata says: why it exists (the CLI's help text) and its range (None: unbounded)."""

    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False


def setting(default: Any, help: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
            hi_open: bool = False) -> Any:
    """A dataclass field with its default, help text and range, e.g. `threshold: float = setting(0.5, "...",
    lo=0.0, hi=1.0)`."""
    return dataclasses.field(default=default, metadata={"about": About(help, lo, hi, lo_open, hi_open)})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def about(cls: type, name: str) -> About:
    """The metadata of field `name` of settings dataclass `cls` (a ConfigError if it has none)."""
    for f in dataclasses.fields(cls):
        if f.name == name and "about" in f.metadata:
            return f.metadata["about"]
    raise ConfigError(f"{cls.__name__} has no setting {name!r}")


def setting_type(cls: type, name: str) -> Any:
    """The type of field `name`: int, float, str, bool, or a Literal of the choices."""
    return _hints(cls)[name]


def default_of(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def choices_of(cls: type, name: str) -> tuple[str, ...] | None:
    """The choices of a Literal field, None for any other."""
    hint = setting_type(cls, name)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def check_setting(cls: type, name: str, value: Any, label: str | None = None, *,
                  error: type[ParseJaxError] = ConfigError) -> Any:
    """`value` for field `name` of `cls`, checked against the field's type and range (as an int or float: 8.0 from
    YAML is 8); errors (`error`: an argument of a call is an InputError) name `label` (default: the field's name),
    the value and what is allowed."""
    label = label or name
    kind, meta = setting_type(cls, name), about(cls, name)
    choices = choices_of(cls, name)
    if choices is not None:
        if name == "segmenter" and isinstance(value, str) and value.startswith("stride:"):  # sweep's value form
            raise error(f"{label} {value!r} is sweep's form of a value; here set {label}='stride' and "
                        f"stride={value.partition(':')[2]} (available segmenters: {', '.join(choices)})")
        return check_choice(label, value, choices, error=error)
    if kind is int:
        return check_int(label, value, meta.lo, meta.hi, error=error)
    if kind is float:
        return check_float(label, value, meta.lo, meta.hi, min_open=meta.lo_open, max_open=meta.hi_open,
                           error=error)
    if kind in (str, bool) and not isinstance(value, kind):
        raise error(f"{label} must be {'a string' if kind is str else 'true or false'}, got {value!r}")
    return value


def check_settings(obj: Any, prefix: str = "") -> None:
    """Every field of frozen dataclass `obj` that carries metadata, checked (and stored as checked); errors name
    `prefix + field`."""
    for f in dataclasses.fields(obj):
        if "about" in f.metadata:
            value = check_setting(type(obj), f.name, getattr(obj, f.name), prefix + f.name)
            object.__setattr__(obj, f.name, value)


# --- the settings ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Token-level speculative decoding with the draft model (mode sd)."""

    gamma: int = setting(4, "draft tokens per target pass in sd mode", lo=1, hi=64)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclasses.dataclass(frozen=True)
class Eagle3Settings:
    """EAGLE-3 drafting (modes eagle3 and parse+eagle3)."""

    gamma: int = setting(5, "EAGLE-3 draft depth per target pass (the chain's length, the tree's depth)", lo=1, hi=64)
    tree: int = setting(0, "EAGLE-3 tree nodes beyond the depth verified per target pass (0: a chain; greedy "
                           "only); the tree has gamma + tree nodes", lo=0, hi=256)
    tree_top_k: int = setting(4, "EAGLE-3 tree: children proposed per node, and the most likely nodes expanded "
                                 "at each depth unless tree_width says fewer", lo=1, hi=32)
    tree_width: int = setting(0, "EAGLE-3 tree: paths the head drafts at each depth (0: tree_top_k, EAGLE-2's "
                                 "expansion; 1: the chain alone, each chain node's next most likely children "
                                 "as leaves, drafted at the chain's cost); at most tree_top_k", lo=0, hi=32)

    def __post_init__(self) -> None:
        check_settings(self, prefix="eagle3_")
        if self.tree_width > self.tree_top_k:
            raise ConfigError(f"eagle3_tree_width must be <= eagle3_tree_top_k ({self.tree_top_k}), got "
                              f"{self.tree_width}")
        if self.tree > self.max_tree:
            raise ConfigError(f"eagle3_tree must be <= {self.max_tree}, got {self.tree}: a tree of depth "
                              f"{self.gamma} (eagle3_gamma) with eagle3_tree_top_k {self.tree_top_k} and "
                              f"eagle3_tree_width {self.tree_width} proposes {self.tree_candidates} candidates, "
                              f"{self.gamma} of them its trunk")

    @property
    def tree_candidates(self) -> int:
        """Nodes a round's expansion proposes (speculation/eagle3/tree.py): the spine's k per depth at width 1,
        else k first tokens and w * k at each later depth; the tree keeps the gamma + tree most likely."""
        k, w = self.tree_top_k, min(self.tree_width or self.tree_top_k, self.tree_top_k)
        return self.gamma * k if w == 1 else k + (self.gamma - 1) * w * k

    @property
    def max_tree(self) -> int:
        """The most nodes beyond the depth that a tree can hold: more would be slots no candidate fills."""
        return self.tree_candidates - self.gamma


@dataclasses.dataclass(frozen=True)
class ParseConfig:
    """PARSE settings; the defaults fit the embedded task's verification format and pair."""

    verify_suffix: str = setting(VERIFY_SUFFIX, "text after a prefix that asks the target to judge it")
    judge_yes: str = setting(JUDGE_YES, "the judge word of a correct prefix")
    judge_no: str = setting(JUDGE_NO, "the judge word of a wrong prefix")
    threshold: float = setting(0.5, "judge score below which a prefix is rejected (1: all, 0: none)", lo=0.0, hi=1.0)
    policy: Policy = setting("earliest_error", "which prefix is accepted: the one before the first rejected, or the "
                                               "longest one accepted")
    segmenter: Segmenter = setting("delimiter", "where the draft is cut into prefixes: at delimiters, every stride "
                                                "tokens, or delimiters with short segments merged and long ones split")
    delimiter: str | tuple[str, ...] = setting(DELIMITER, "step ends, matched in the decoded text; one or several")
    stride: int = setting(8, "segmenter stride: a prefix every STRIDE tokens", lo=1, hi=4096)
    min_segment: int = setting(4, "segmenter hybrid: shorter delimiter segments merge into the next", lo=1, hi=4096)
    max_segment: int = setting(32, "segmenter hybrid: longer segments split; multi round: the target writes at most "
                                   "this many tokens a round", lo=1, hi=4096)
    max_prefixes: int = setting(8, "prefixes verified per pass (K; the full draft always among them)", lo=1, hi=256)
    prefix_choice: PrefixChoice = setting("spread", "which step ends are verified: spread evenly over the draft "
                                                    "when it has more than K; confidence: those before the steps the "
                                                    "draft is least sure of (its lowest token probability), up to "
                                                    "K - 1; auto: per row, those whose expected saving (from the "
                                                    "draft's probabilities) pays for their suffix copy at this "
                                                    "batch's pass costs, up to K - 1 (docs/design.md §2)")
    prefix_confidence: float = setting(1.0, "prefix_choice confidence / auto: a step end is verified only where the "
                                            "next step's least likely draft token is at most this likely (1: any; "
                                            "lower: fewer prefixes, a shorter verification block)", lo=0.0, hi=1.0)
    rounds: RoundsSetting = setting("auto", "multi: the target writes one step, then the draft drafts again; single: "
                                            "it writes the rest (modes parse and parse+eagle3); auto: schedule=auto "
                                            "chooses per batch from the costs and what it measured (parse in one "
                                            "slot, and schedule=fixed: multi)")
    max_draft_tokens: int = setting(64, "tokens the draft writes per round", lo=1, hi=4096)
    suffix_format: SuffixFormat = setting("plain", "chat: verify_suffix is the judge question of a user turn, "
                                                   "rendered through the target's chat template after the draft "
                                                   "(docs/design.md)")
    schedule: Schedule = setting("auto", "auto: before each batch, run plain decoding where the cost model (and "
                                          "what earlier batches measured) says speculation would be slower; fixed: "
                                          "always speculate as configured (docs/design.md §7)")
    speculation: SpecSettings = SpecSettings()
    eagle3: Eagle3Settings = Eagle3Settings()

    @property
    def delimiters(self) -> tuple[str, ...]:
        return (self.delimiter,) if isinstance(self.delimiter, str) else tuple(self.delimiter)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.min_segment > self.max_segment:
            raise ConfigError(f"min_segment ({self.min_segment}) > max_segment ({self.max_segment})")
        delims = (self.delimiter,) if isinstance(self.delimiter, str) else self.delimiter
        if not isinstance(delims, (tuple, list)) or not delims or not all(isinstance(d, str) and d for d in delims):
            raise ConfigError(f"delimiter must be a non-empty string or a list of them, got {self.delimiter!r}")
        if not isinstance(self.delimiter, str):
            object.__setattr__(self, "delimiter", tuple(self.delimiter))  # frozen
        if not self.verify_suffix:
            raise ConfigError("verify_suffix is empty")
        for name in ("judge_yes", "judge_no"):  # what needs no tokenizer is checked here; the rest by the engine
            if not getattr(self, name).strip():
                raise ConfigError(f"{name} is empty or only whitespace: a judge word must be text")
        if self.judge_yes == self.judge_no:
            raise ConfigError(f"judge_yes and judge_no are the same word ({self.judge_yes!r}): the judge could not "
                              "tell a correct prefix from a wrong one")
        if not isinstance(self.speculation, SpecSettings) or not isinstance(self.eagle3, Eagle3Settings):
            raise ConfigError("speculation / eagle3 must be SpecSettings / Eagle3Settings")

    # --- the flat names of config files and the CLI --------------------------------------------------------

    FLAT_GROUPS = {"gamma": ("speculation", "gamma"), "eagle3_gamma": ("eagle3", "gamma"),
                   "eagle3_tree": ("eagle3", "tree"), "eagle3_tree_top_k": ("eagle3", "tree_top_k"),
                   "eagle3_tree_width": ("eagle3", "tree_width")}

    @classmethod
    def flat_setting(cls, key: str) -> tuple[type, str]:
        """(settings class, field name) of a flat setting name: ("gamma" -> SpecSettings.gamma); a ConfigError for
        an unknown name."""
        if key in cls.FLAT_GROUPS:
            group, field = cls.FLAT_GROUPS[key]
            return setting_type(cls, group), field
        if key in cls.flat_fields():
            return cls, key
        raise ConfigError(f"unknown PARSE setting {key!r}; the settings are: {', '.join(cls.flat_fields())}")

    @classmethod
    def flat_fields(cls) -> dict[str, Any]:
        """Every flat setting name -> its default (the type a value must have)."""
        out = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in ("speculation", "eagle3")}
        defaults = cls()
        out.update({key: getattr(getattr(defaults, group), field) for key, (group, field) in cls.FLAT_GROUPS.items()})
        return out

    @classmethod
    def from_flat(cls, base: ParseConfig | None = None, **settings: Any) -> ParseConfig:
        """`base` (default: the defaults) with flat settings replaced; an unknown name is a ConfigError."""
        base = base or cls()
        known = cls.flat_fields()
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ConfigError(f"unknown PARSE setting(s) {', '.join(unknown)}; the settings are: {', '.join(known)}")
        groups: dict[str, dict[str, Any]] = {"speculation": {}, "eagle3": {}}
        plain = {}
        for key, value in settings.items():
            if key in cls.FLAT_GROUPS:
                group, field = cls.FLAT_GROUPS[key]
                groups[group][field] = value
            else:
                plain[key] = value
        return dataclasses.replace(base, **plain,
                                   speculation=dataclasses.replace(base.speculation, **groups["speculation"]),
                                   eagle3=dataclasses.replace(base.eagle3, **groups["eagle3"]))

    def resolved(self, rounds: Rounds | None = None) -> ParseConfig:
        """This config with a concrete `rounds` (what the modes run): `rounds` when given, else the setting, with
        "auto" as multi (the choice of schedule=fixed; schedule=auto passes its own per batch)."""
        if rounds is None:
            rounds = "multi" if self.rounds == "auto" else self.rounds
        return self if rounds == self.rounds else dataclasses.replace(self, rounds=rounds)

    def flat(self) -> dict[str, Any]:
        """The flat settings of this config (what a results header records)."""
        out = {k: getattr(self, k) for k in self.flat_fields() if k not in self.FLAT_GROUPS}
        out.update({key: getattr(getattr(self, group), field) for key, (group, field) in self.FLAT_GROUPS.items()})
        return out

    # --- reading and writing PARSE settings files -------------------------------------------------------

    @classmethod
    def load(cls, source: str | os.PathLike | Mapping[str, Any] | ParseConfig, **overrides: Any) -> ParseConfig:
        """PARSE settings from `source`: a shipped config by name (`"qwen3_chat"`: configs/parse/NAME.yaml), a YAML
        or JSON file, a JSON string (`'{"threshold": 0.3}'`), a mapping of flat settings, or a ParseConfig; then the
        flat `overrides`. Settings not given keep their defaults. Every key must be a setting and every value of its
        type and range; a key given twice in a file is refused (ConfigError naming the source, the key and the value).
        """
        if isinstance(source, ParseConfig):
            return cls.from_flat(source, **read_settings(overrides, "overrides")) if overrides else source
        fields = read_source(source)
        fields.update(read_settings(overrides, "overrides"))
        return cls.from_flat(**fields)

    def save(self, path: str | os.PathLike, *, comment: str | None = None) -> Path:
        """Write every setting (flat names) to `path`, YAML unless it ends in .json, atomically (the old file stays
        whole until the new one is complete); `ParseConfig.load(path)` reads back an equal config. `comment`: a
        line of YAML comment after the header (how the file came about); JSON has no comments and ignores it."""
        from parse_jax.utils.atomic import write_text

        flat = {k: list(v) if isinstance(v, tuple) else v for k, v in self.flat().items()}
        path = Path(path)
        if path.suffix.lower() == ".json":
            return write_text(path, json.dumps(flat, indent=2, ensure_ascii=False) + "\n")
        from parse_jax.utils.yaml_file import write_yaml

        note = "".join(f"# {line}\n" for line in (comment or "").splitlines())
        return write_text(path, "# PARSE settings (parse_jax.ParseConfig.save); read with ParseConfig.load or "
                                "--parse-config\n" + note + write_yaml(flat))


PARSE_CONFIG_DIR = config_dir() / "parse"


def shipped_parse_configs() -> list[str]:
    """The names of the shipped PARSE configs (configs/parse/NAME.yaml)."""
    return sorted(p.stem for p in PARSE_CONFIG_DIR.glob("*.yaml")) if PARSE_CONFIG_DIR.is_dir() else []


def check_config(config: Any) -> None:
    """A `ParseConfig` or None (the defaults): anything else is one clear error, whichever entry point took it."""
    if config is not None and not isinstance(config, ParseConfig):
        raise ConfigError(f"config must be a pj.ParseConfig, got {type(config).__name__}")


def read_source(source: str | os.PathLike | Mapping[str, Any], where: str | None = None) -> dict[str, Any]:
    """The checked flat settings of one source (see `ParseConfig.load`); errors name `where` (default: the source
    itself)."""
    from parse_jax.utils.yaml_file import read_json, read_yaml

    if isinstance(source, Mapping):
        return read_settings(source, where or "PARSE settings")
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"PARSE settings must be a shipped name, a YAML/JSON path, a JSON string or a mapping, got "
                          f"{type(source).__name__}")
    if not os.fspath(source).strip():
        raise ConfigError(f"{where or 'PARSE config'} is empty: give a shipped name ("
                          f"{', '.join(shipped_parse_configs()) or 'none'}), a YAML/JSON path, a JSON string or a "
                          "mapping")
    if isinstance(source, str) and source.lstrip().startswith("{"):
        where = where or "PARSE settings JSON"
        return read_settings(_mapping(read_json(source, where), where), where)
    path = Path(source)
    if isinstance(source, str) and not path.exists() and (PARSE_CONFIG_DIR / f"{source}.yaml").is_file():
        path = PARSE_CONFIG_DIR / f"{source}.yaml"  # a shipped PARSE config by name, e.g. qwen3_chat
    elif isinstance(source, str) and not path.exists() and not path.suffix and os.sep not in source:
        raise ConfigError(f"{where or 'PARSE config'} {source!r}: no such file and no shipped PARSE config of that "
                          f"name; shipped: {', '.join(shipped_parse_configs()) or 'none'}")
    where = where or f"PARSE config {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text") from None
    loaded = read_json(text, where) if path.suffix.lower() == ".json" else read_yaml(text, where)
    return read_settings(_mapping({} if loaded is None else loaded, where), where)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must hold a mapping of ParseConfig fields (threshold: 0.5, ...), got "
                          f"{type(value).__name__}")
    return value


def read_settings(settings: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Flat settings checked one by one: each key a setting, each value of its type and range (errors name `where`,
    the key and the value)."""
    return dict(read_setting(key, value, where) for key, value in settings.items())


def read_setting(key: Any, value: Any, where: str, raw: str | None = None) -> tuple[str, Any]:
    """(key, value) of one flat setting, checked. `raw`: the text of a `--set KEY=VALUE` (a text setting keeps it as
    given unless it is a quoted YAML string: `--set judge_yes=Yes` is "Yes", not YAML's true)."""
    fields = ParseConfig.flat_fields()
    if key not in fields:
        raise ConfigError(f"{where}: unknown PARSE setting {key!r}; the settings are ParseConfig's fields: "
                          f"{', '.join(fields)}")
    kind = type(fields[key])
    if key == "delimiter" and isinstance(value, (list, tuple)):  # several delimiters: a list of strings
        if not value or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{where}: delimiter must be a string or a list of non-empty strings, got {value!r}")
        return key, tuple(value)
    if kind is str:
        if raw is not None:
            value = value if raw.strip()[:1] in ("'", '"') else raw  # a quoted value is YAML's: "\n\n" is newlines
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {key} must be a string, got {value!r} (quote it in YAML)")
        return key, value
    return key, check_setting(*ParseConfig.flat_setting(key), value, f"{where}: {key}")


def read_set_item(item: str) -> tuple[str, Any]:
    """(key, value) of one `--set KEY=VALUE`, the value read as a YAML scalar, checked."""
    from parse_jax.utils.yaml_file import read_yaml_scalar

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set threshold=0.3")
    return read_setting(key.strip(), read_yaml_scalar(raw), f"--set {item}", raw=raw)
