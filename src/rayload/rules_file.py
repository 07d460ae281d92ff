"""Pydantic models for what users write: sharding rules files.

These models live at the boundary only (``extra="forbid"``, so a typo is an error rather
than a silently ignored key); the library works on the frozen dataclasses they are turned
into (:class:`rayload.loading.rules.RuleSet`).

A rules file is JSON::

    {
      "rules": [
        {"pattern": "model\\\\.layers\\\\.\\\\d+\\\\.mlp\\\\.down_proj\\\\.weight", "split": 1},
        {"pattern": "model\\\\.norm\\\\.weight", "split": "replicate"}
      ],
      "use_preset": true
    }

``pattern`` is a Python regular expression matched against the *whole* tensor name
(``re.fullmatch``). ``split`` is ``0``, ``1`` or ``"replicate"``. The first matching rule
wins. ``parts`` (optional) describes the split dimension as attention heads or as fused
components, in order: ``"q"`` (the query heads), ``"kv"`` (the key/value heads) and
``"even"`` (an equal share of what the other parts leave): ``["q"]`` for ``q_proj``,
``["kv"]`` for ``k_proj``, ``["q", "kv", "kv"]`` for a fused ``qkv_proj``,
``["even", "even"]`` for a fused ``gate_up_proj``, ``["heads"]`` for a dimension of
``num_attention_heads`` heads of another width (DeepSeek's MLA projections). Head counts
come from ``config.json``; ``head_size`` (optional) overrides its head dimension.
With ``use_preset`` the architecture's preset rules are tried after the file's, so a file
can override a few tensors and keep the rest. See docs/sharding.md.
"""

from __future__ import annotations

import json
import os
import re
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rayload.errors import ConfigError

SplitSpec = Literal[0, 1, "replicate"]
PartSpec = Literal["q", "kv", "even", "heads"]


class RuleSpec(BaseModel):
    """One rule as written in a rules file or a converted checkpoint's manifest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pattern: str = Field(min_length=1, description="regex matched against the whole name")
    split: SplitSpec = Field(description='0, 1 or "replicate"')
    parts: list[PartSpec] | None = Field(
        default=None,
        description="the split dimension as heads or fused parts: q, kv, even, heads",
    )
    head_size: int | None = Field(
        default=None, ge=1, description="head dimension of q/kv parts (default: config.json's)"
    )

    @field_validator("split", mode="before")
    @classmethod
    def _no_lookalikes(cls, split: object) -> object:
        if isinstance(split, bool) or not isinstance(split, int | str):
            raise ValueError(f'split must be 0, 1 or "replicate", not {split!r}')
        return split

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(
                f"pattern {pattern!r} is not a valid regular expression: {exc}"
            ) from exc
        return pattern

    @model_validator(mode="after")
    def _parts_need_a_split(self) -> RuleSpec:
        if self.parts is not None and (self.split == "replicate" or not self.parts):
            raise ValueError("parts need a split dimension (0 or 1) and at least one part")
        if self.head_size is not None and not set(self.parts or ()) & {"q", "kv"}:
            raise ValueError('head_size applies to "q" or "kv" parts only')
        return self


class RulesFile(BaseModel):
    """A user's sharding rules file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: list[RuleSpec] = Field(description="tried in order; the first match wins")
    use_preset: bool = Field(
        default=False, description="after these rules, try the architecture's preset"
    )


def load_rules_file(path: str | os.PathLike[str]) -> RulesFile:
    """Read and validate the rules file at ``path``; :class:`ConfigError` names the file and
    the first problem."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"rules file {name}: cannot read it ({exc.strerror})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"rules file {name}: not valid JSON ({exc})") from exc
    except RecursionError as exc:
        raise ConfigError(f"rules file {name}: JSON nested too deeply to parse") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"rules file {name}: the top level is a JSON {type(data).__name__}; the file must "
            'be an object: {"rules": [{"pattern": "...", "split": 0}, ...]}'
        )
    try:
        return RulesFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"rules file {name}: {describe_validation_error(exc)}") from exc


def describe_validation_error(exc: ValidationError) -> str:
    """The first problem of a pydantic error as one line: ``at rules.0.split: ...``."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "top level"
    more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
    return f"at {where}: {first['msg']}{more}"
