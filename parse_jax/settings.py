"""Typed settings of the engine: PARSE's own (`ParseConfig`), token-level speculation's (`SpecSettings`) and
EAGLE-3's (`Eagle3Settings`), each validated where it is built (parse_jax.utils.validation), choices as Literal types.

Config files and the CLI name every setting flat (`gamma`, `eagle3_gamma`, `eagle3_tree` beside PARSE's):
`ParseConfig.from_flat` and `ParseConfig.flat_fields` map those names onto the groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from parse_jax.errors import ConfigError
from parse_jax.tasks import DELIMITER, JUDGE_NO, JUDGE_YES, VERIFY_SUFFIX
from parse_jax.utils.validation import check_choice, check_float, check_int
from parse_jax.verify.scoring import POLICIES
from parse_jax.verify.segment import SEGMENTERS, Segmenter

Policy = Literal["earliest_error", "longest_valid"]
Rounds = Literal["single", "multi"]
SuffixFormat = Literal["plain", "chat"]
ROUNDS: tuple[str, ...] = ("single", "multi")
SUFFIX_FORMATS: tuple[str, ...] = ("plain", "chat")
Mode = Literal["target", "sd", "sequential", "parse", "eagle3", "parse+eagle3"]
MODES: tuple[str, ...] = ("target", "sd", "sequential", "parse", "eagle3", "parse+eagle3")


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Token-level speculative decoding with the draft model (mode sd)."""

    gamma: int = 4  # draft tokens per target pass

    def __post_init__(self) -> None:
        object.__setattr__(self, "gamma", check_int("gamma", self.gamma, 1, 64))


@dataclasses.dataclass(frozen=True)
class Eagle3Settings:
    """EAGLE-3 drafting (modes eagle3 and parse+eagle3)."""

    gamma: int = 5  # chain length per target pass
    tree: int = 0   # sibling leaves per round (0: a chain); greedy only

    def __post_init__(self) -> None:
        object.__setattr__(self, "gamma", check_int("eagle3_gamma", self.gamma, 1, 64))
        object.__setattr__(self, "tree", check_int("eagle3_tree", self.tree, 0, 64))


@dataclasses.dataclass(frozen=True)
class ParseConfig:
    """PARSE settings; the defaults fit the embedded task's verification format and pair."""

    verify_suffix: str = VERIFY_SUFFIX
    judge_yes: str = JUDGE_YES
    judge_no: str = JUDGE_NO
    threshold: float = 0.5          # a prefix whose judge score is below this is rejected; 1: all, 0: none
    policy: Policy = "earliest_error"
    segmenter: Segmenter = "delimiter"
    delimiter: str | tuple[str, ...] = DELIMITER  # step ends, matched in the decoded text; one or several
    stride: int = 8                 # segmenter "stride": a prefix every `stride` tokens
    min_segment: int = 4            # segmenter "hybrid": shorter delimiter segments merge into the next
    max_segment: int = 32           # "hybrid": longer ones split; multi round: the target writes at most this
    max_prefixes: int = 8           # prefixes scored per pass (the full draft always among them)
    rounds: Rounds = "multi"        # multi: the target writes one step, then the draft drafts again;
    #                                 single: it writes the rest (mode parse; parse+eagle3 is always single)
    max_draft_tokens: int = 64
    suffix_format: SuffixFormat = "plain"  # chat: verify_suffix is the judge question of a user turn, rendered
    #                                       through the target's chat template after the draft (see docs/design.md)
    speculation: SpecSettings = SpecSettings()
    eagle3: Eagle3Settings = Eagle3Settings()

    @property
    def delimiters(self) -> tuple[str, ...]:
        return (self.delimiter,) if isinstance(self.delimiter, str) else tuple(self.delimiter)

    def __post_init__(self) -> None:
        check_choice("policy", self.policy, POLICIES)
        check_choice("segmenter", self.segmenter, SEGMENTERS)
        check_choice("rounds", self.rounds, ROUNDS)
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        fix("threshold", check_float("threshold", self.threshold, 0.0, 1.0))
        for name, top in (("stride", 4096), ("min_segment", 4096), ("max_segment", 4096), ("max_prefixes", 256),
                          ("max_draft_tokens", 4096)):
            fix(name, check_int(name, getattr(self, name), 1, top))
        if self.min_segment > self.max_segment:
            raise ConfigError(f"min_segment ({self.min_segment}) > max_segment ({self.max_segment})")
        for name in ("verify_suffix", "judge_yes", "judge_no"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be a string, got {value!r}")
        delims = (self.delimiter,) if isinstance(self.delimiter, str) else self.delimiter
        if not isinstance(delims, (tuple, list)) or not delims or not all(isinstance(d, str) and d for d in delims):
            raise ConfigError(f"delimiter must be a non-empty string or a list of them, got {self.delimiter!r}")
        if not isinstance(self.delimiter, str):
            fix("delimiter", tuple(self.delimiter))
        check_choice("suffix_format", self.suffix_format, SUFFIX_FORMATS)
        if not self.verify_suffix:
            raise ConfigError("verify_suffix is empty")
        if not isinstance(self.speculation, SpecSettings) or not isinstance(self.eagle3, Eagle3Settings):
            raise ConfigError("speculation / eagle3 must be SpecSettings / Eagle3Settings")

    # --- the flat names of config files and the CLI --------------------------------------------------------

    FLAT_GROUPS = {"gamma": ("speculation", "gamma"), "eagle3_gamma": ("eagle3", "gamma"),
                   "eagle3_tree": ("eagle3", "tree")}

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

    def flat(self) -> dict[str, Any]:
        """The flat settings of this config (what a results header records)."""
        out = {k: getattr(self, k) for k in self.flat_fields() if k not in self.FLAT_GROUPS}
        out.update({key: getattr(getattr(self, group), field) for key, (group, field) in self.FLAT_GROUPS.items()})
        return out
