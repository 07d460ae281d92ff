"""Sharding rules: which dimension of each tensor is cut across TP ranks, and how.

A :class:`Rule` maps a regular expression, matched against the *whole* tensor name
(``re.fullmatch``), to a split: ``0`` (rows: column-parallel linears, vocab-parallel
embeddings), ``1`` (columns: row-parallel linears) or ``None`` (replicated on every
rank). Rules are tried in order and the first match wins; a tensor no rule matches is
replicated, and the plan reports it (see :class:`rayload.loading.plan.ShardPlan`).

A rule's ``parts`` describe its split dimension as attention heads or fused components
(see :mod:`rayload.loading.heads`): ``("q",)`` cuts in whole query heads, ``("kv",)`` in
whole key/value heads (replicated over ``tp / kv_heads`` ranks when there are fewer KV
heads than ranks), ``("q", "kv", "kv")`` is a fused QKV tensor whose every rank gets its
part of q, of k and of v, concatenated, ``("even", "even")`` a fused gate/up tensor. These
are vLLM's conventions (``QKVParallelLinear``, ``MergedColumnParallelLinear``); the
conventions are data here, not branches on an architecture name.

A pattern with an ``expert`` group (``experts\\.(?P<expert>\\d+)\\.``) marks an expert's
tensors: with expert parallel (:func:`rayload.loading.plan.plan_shards`) they are not
split but held whole by the rank that owns the expert.

Presets cover the Hugging Face names of the Llama family (Llama, Mistral, Qwen2/3,
Qwen-MoE, Mixtral, Phi-3), DeepSeek-V2/V3 and GPT-2, chosen from ``config.json``
``architectures``; users can pass a rules file (:mod:`rayload.rules_file`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from rayload.errors import ConfigError
from rayload.loading.heads import PARTS
from rayload.rules_file import PartSpec, RulesFile, RuleSpec, SplitSpec, load_rules_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    """Tensors whose whole name matches ``pattern`` are split on ``split`` (None: replicated).

    ``parts`` lay out the split dimension as heads or fused components (empty: one even
    part); ``head_size`` overrides config.json's head dimension for ``q``/``kv`` parts.
    """

    pattern: str
    split: int | None
    parts: tuple[str, ...] = ()
    head_size: int | None = None
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.split not in (0, 1, None) or isinstance(self.split, bool):
            raise ConfigError(f"rule {self.pattern!r}: split must be 0, 1 or None (replicate)")
        if unknown := [p for p in self.parts if p not in PARTS]:
            raise ConfigError(
                f"rule {self.pattern!r}: unknown part {unknown[0]!r}; parts are {', '.join(PARTS)}"
            )
        if self.parts and self.split is None:
            raise ConfigError(f"rule {self.pattern!r}: parts need a split dimension (0 or 1)")
        try:
            object.__setattr__(self, "_regex", re.compile(self.pattern))
        except re.error as exc:
            raise ConfigError(
                f"rule {self.pattern!r} is not a valid regular expression: {exc}"
            ) from exc

    def matches(self, name: str) -> bool:
        return self._regex.fullmatch(name) is not None

    def expert_id(self, name: str) -> int | None:
        """The expert a tensor belongs to: the ``expert`` group of the pattern
        (``experts\\.(?P<expert>\\d+)\\.``), or None for a pattern without one or a name
        it matched without it (a shared expert)."""
        if "expert" not in self._regex.groupindex:
            return None
        match = self._regex.fullmatch(name)
        value = match.group("expert") if match else None
        return int(value) if value is not None else None

    @classmethod
    def from_spec(cls, spec: RuleSpec) -> Rule:
        split = None if spec.split == "replicate" else spec.split
        return cls(spec.pattern, split, tuple(spec.parts or ()), spec.head_size)

    def to_spec(self) -> RuleSpec:
        split: SplitSpec = "replicate" if self.split is None else (0 if self.split == 0 else 1)
        parts = cast("list[PartSpec]", list(self.parts)) or None
        return RuleSpec(pattern=self.pattern, split=split, parts=parts, head_size=self.head_size)


@dataclass(frozen=True)
class RuleSet:
    """Ordered rules plus where they came from (a preset name, a file path, or "none").

    The first ``user_rules`` rules are the user's own (a rules file or rules passed in);
    the rest come from a preset.
    """

    rules: tuple[Rule, ...]
    source: str
    user_rules: int = 0

    def unused_user_rules(self, names: Iterable[str]) -> tuple[Rule, ...]:
        """The user's rules that match none of ``names`` (almost always a pattern written
        to match part of a name: patterns must match the whole name)."""
        user = self.rules[: self.user_rules]
        used = {i for name in names for i, rule in enumerate(user) if rule.matches(name)}
        return tuple(rule for i, rule in enumerate(user) if i not in used)

    def match(self, name: str) -> Rule | None:
        """The first rule matching ``name``, or None."""
        return next((rule for rule in self.rules if rule.matches(name)), None)

    def split_for(self, name: str) -> int | None:
        """0, 1 or None; None also when no rule matches."""
        rule = self.match(name)
        return rule.split if rule else None


def _rules(*rules: tuple[str, int | None] | tuple[str, int, tuple[str, ...]]) -> tuple[Rule, ...]:
    return tuple(Rule(*rule) for rule in rules)


_Q, _KV, _QKV, _HALVES = ("q",), ("kv",), ("q", "kv", "kv"), ("even", "even")
_HEADS = ("heads",)

_LAYER = r"model\.layers\.\d+\."
_EXPERT = r"experts\.(?P<expert>\d+)\."
"""An expert's tensors: the ``expert`` group names the expert (expert parallel)."""
_MLP = _LAYER + r"mlp\.(?:" + _EXPERT + r"|shared_experts?\.)?"

_DECODER = _rules(
    (r"model\.embed_tokens\.weight", 0),  # vocab-parallel embedding
    (r"lm_head\.weight", 0),  # vocab-parallel output projection
    (_LAYER + r"self_attn\.q_proj\.(?:weight|bias)", 0, _Q),  # column-parallel, whole heads
    (_LAYER + r"self_attn\.[kv]_proj\.(?:weight|bias)", 0, _KV),
    (_LAYER + r"self_attn\.qkv_proj\.(?:weight|bias)", 0, _QKV),  # Phi-3: fused q|k|v
    (_LAYER + r"self_attn\.o_proj\.weight", 1, _Q),  # row-parallel, whole heads
    (_MLP + r"(?:gate|up)_proj\.weight", 0),
    (_MLP + r"gate_up_proj\.weight", 0, _HALVES),  # Phi-3: fused gate|up
    (_MLP + r"down_proj\.weight", 1),
    (_LAYER + r"(?:input_layernorm|post_attention_layernorm)\.weight", None),
    (_LAYER + r"self_attn\.(?:q_norm|k_norm)\.weight", None),  # Qwen3 per-head norms
    (_LAYER + r"self_attn\.o_proj\.bias", None),
    (_LAYER + r"self_attn\.rotary_emb\.inv_freq", None),  # older Llama checkpoints
    (_LAYER + r"mlp\.(?:gate|shared_expert_gate)\.weight", None),  # MoE routers
    (r"model\.norm\.weight", None),
)
"""Llama-style decoder: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3, Qwen2/3-MoE."""

_MIXTRAL = _rules(
    (_LAYER + r"block_sparse_moe\." + _EXPERT + r"w[13]\.weight", 0),
    (_LAYER + r"block_sparse_moe\." + _EXPERT + r"w2\.weight", 1),
    (_LAYER + r"block_sparse_moe\.gate\.weight", None),
)

_DEEPSEEK = _rules(
    # Multi-head latent attention, as vLLM shards it: the up-projections to the heads are
    # column-parallel and o_proj row-parallel, each cut in whole heads of their own width;
    # the low-rank down-projections (ReplicatedLinear in vLLM) and their norms replicated.
    (_LAYER + r"self_attn\.(?:q_proj|q_b_proj|kv_b_proj)\.weight", 0, _HEADS),
    (_LAYER + r"self_attn\.o_proj\.weight", 1, _HEADS),
    (_LAYER + r"self_attn\.(?:q_a_proj|kv_a_proj_with_mqa)\.weight", None),
    (_LAYER + r"self_attn\.(?:q_a_layernorm|kv_a_layernorm)\.weight", None),
    (_LAYER + r"mlp\.gate\.e_score_correction_bias", None),  # DeepSeek-V3 router bias
)
"""DeepSeek-V2/V3 attention; experts, shared experts and the rest as the decoder."""

_GPT2_LAYER = r"transformer\.h\.\d+\."

_GPT2 = _rules(
    # Conv1D layout: weights are stored (in_features, out_features), so a column-parallel
    # linear splits dim 1 and a row-parallel one dim 0: the swap of a Linear's split dims.
    (r"transformer\.wte\.weight", 0),  # vocab-parallel (the tied output projection too)
    (r"lm_head\.weight", 0),
    (r"transformer\.wpe\.weight", None),
    (_GPT2_LAYER + r"attn\.c_attn\.weight", 1, _QKV),  # fused q|k|v along out_features
    (_GPT2_LAYER + r"attn\.c_attn\.bias", 0, _QKV),
    (_GPT2_LAYER + r"attn\.c_proj\.weight", 0, _Q),  # row-parallel: in_features, by head
    (_GPT2_LAYER + r"mlp\.c_fc\.weight", 1),
    (_GPT2_LAYER + r"mlp\.c_fc\.bias", 0),
    (_GPT2_LAYER + r"mlp\.c_proj\.weight", 0),
    (_GPT2_LAYER + r"(?:attn|mlp)\.c_proj\.bias", None),  # added once, after the all-reduce
    (_GPT2_LAYER + r"ln_[12]\.(?:weight|bias)", None),
    (_GPT2_LAYER + r"attn\.(?:bias|masked_bias)", None),  # causal-mask buffers, older files
    (r"transformer\.ln_f\.(?:weight|bias)", None),
)
"""GPT-2 (``GPT2LMHeadModel``), Conv1D layout."""

PRESETS: dict[str, tuple[Rule, ...]] = {
    "LlamaForCausalLM": _DECODER,
    "MistralForCausalLM": _DECODER,
    "Qwen2ForCausalLM": _DECODER,
    "Qwen3ForCausalLM": _DECODER,
    "Qwen2MoeForCausalLM": _DECODER,
    "Qwen3MoeForCausalLM": _DECODER,
    "MixtralForCausalLM": _MIXTRAL + _DECODER,
    "DeepseekV2ForCausalLM": _DEEPSEEK + _DECODER,
    "DeepseekV3ForCausalLM": _DEEPSEEK + _DECODER,
    "Phi3ForCausalLM": _DECODER,
    "GPT2LMHeadModel": _GPT2,
}
"""config.json ``architectures`` value -> preset rules."""

RulesArg = str | os.PathLike[str] | RuleSet | RulesFile | Sequence[Rule] | None
"""What :func:`resolve_rules` (and so ``plan_shards(rules=...)``) accepts."""


def resolve_rules(rules: RulesArg, architecture: str | None) -> RuleSet:
    """Turn the user's ``rules`` (a rules file path, a parsed file, rules, or None) into the
    :class:`RuleSet` to plan with.

    None means the preset for ``architecture``; with no preset every tensor is replicated
    and a warning is logged (the plan also reports every unmatched tensor).
    """
    if isinstance(rules, RuleSet):
        return rules
    if rules is None:
        preset = preset_for(architecture)
        if preset is None:
            log.warning(
                "no sharding preset for architecture %s: every tensor will be replicated; "
                "pass a rules file to shard it",
                architecture,
            )
            return RuleSet((), "none")
        return preset
    if isinstance(rules, str | os.PathLike):
        return _from_file(load_rules_file(rules), architecture, source=os.fspath(rules))
    if isinstance(rules, RulesFile):
        return _from_file(rules, architecture, source="rules file")
    checked = tuple(_checked(rules))
    return RuleSet(checked, "rules", len(checked))


def unused_rule_message(pattern: str) -> str:
    """What to tell the user about a rule of theirs that matched no tensor."""
    return (
        f"rule {pattern!r} matches no tensor; a pattern must match the whole tensor name "
        "(e.g. '.*q_proj.*', not 'q_proj')"
    )


def preset_for(architecture: str | None) -> RuleSet | None:
    """The preset for an ``architectures`` entry, or None when rayload has none."""
    if architecture is None or architecture not in PRESETS:
        return None
    return RuleSet(PRESETS[architecture], f"preset:{architecture}")


def _from_file(parsed: RulesFile, architecture: str | None, *, source: str) -> RuleSet:
    rules = tuple(Rule.from_spec(spec) for spec in parsed.rules)
    if parsed.use_preset:
        preset = preset_for(architecture)
        if preset is None:
            raise ConfigError(
                f"{source}: use_preset is set but rayload has no preset for architecture "
                f"{architecture} (presets: {', '.join(PRESETS)}); list every rule instead"
            )
        return RuleSet(rules + preset.rules, f"{source} + {preset.source}", len(rules))
    return RuleSet(rules, source, len(rules))


def _checked(rules: Iterable[object]) -> Iterable[Rule]:
    for rule in rules:
        if not isinstance(rule, Rule):
            raise ConfigError(f"sharding rules must be Rule objects, got {rule!r}")
        yield rule
