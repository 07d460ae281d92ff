from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rayload.errors import ConfigError
from rayload.loading.plan import plan_shards
from rayload.loading.rules import PRESETS, Rule, RuleSet, preset_for, resolve_rules
from rayload.rules_file import RulesFile, load_rules_file

# Real Hugging Face tensor names (Llama-3 / Mistral / Qwen2 / Qwen3 / Mixtral checkpoints).
LLAMA_NAMES = {
    "model.embed_tokens.weight": 0,
    "lm_head.weight": 0,
    "model.layers.0.self_attn.q_proj.weight": 0,
    "model.layers.11.self_attn.k_proj.weight": 0,
    "model.layers.11.self_attn.v_proj.weight": 0,
    "model.layers.11.self_attn.o_proj.weight": 1,
    "model.layers.3.mlp.gate_proj.weight": 0,
    "model.layers.3.mlp.up_proj.weight": 0,
    "model.layers.3.mlp.down_proj.weight": 1,
    "model.layers.3.input_layernorm.weight": None,
    "model.layers.3.post_attention_layernorm.weight": None,
    "model.norm.weight": None,
}
QWEN2_NAMES = {
    **LLAMA_NAMES,
    "model.layers.0.self_attn.q_proj.bias": 0,
    "model.layers.0.self_attn.k_proj.bias": 0,
    "model.layers.0.self_attn.v_proj.bias": 0,
}
QWEN3_NAMES = {
    **LLAMA_NAMES,
    "model.layers.0.self_attn.q_norm.weight": None,
    "model.layers.0.self_attn.k_norm.weight": None,
}
MIXTRAL_NAMES = {
    **{k: v for k, v in LLAMA_NAMES.items() if ".mlp." not in k},
    "model.layers.0.block_sparse_moe.gate.weight": None,
    "model.layers.0.block_sparse_moe.experts.7.w1.weight": 0,
    "model.layers.0.block_sparse_moe.experts.7.w3.weight": 0,
    "model.layers.0.block_sparse_moe.experts.7.w2.weight": 1,
}


@pytest.mark.parametrize(
    ("architecture", "names"),
    [
        ("LlamaForCausalLM", LLAMA_NAMES),
        ("MistralForCausalLM", LLAMA_NAMES),
        ("Qwen2ForCausalLM", QWEN2_NAMES),
        ("Qwen3ForCausalLM", QWEN3_NAMES),
        ("MixtralForCausalLM", MIXTRAL_NAMES),
    ],
)
def test_preset_splits_real_hf_names(architecture: str, names: dict[str, int | None]) -> None:
    preset = preset_for(architecture)
    assert preset is not None
    for name, split in names.items():
        assert preset.match(name) is not None, f"{name} matched by no rule"
        assert preset.split_for(name) == split, name


def test_preset_does_not_match_lookalike_names() -> None:
    preset = preset_for("LlamaForCausalLM")
    assert preset is not None
    for name in [
        "model.layers.0.self_attn.q_proj.weight.extra",
        "prefix.model.norm.weight",
        "model.layers.x.mlp.down_proj.weight",
        "model.layers.0.vision_tower.q_proj.weight",
    ]:
        assert preset.match(name) is None, name


def test_unknown_architecture_has_no_preset() -> None:
    assert preset_for("BertForMaskedLM") is None
    assert preset_for(None) is None
    assert resolve_rules(None, "BertForMaskedLM").rules == ()


def test_every_preset_rule_is_a_valid_rule() -> None:
    for rules in PRESETS.values():
        assert all(isinstance(rule, Rule) and rule.split in (0, 1, None) for rule in rules)


def test_first_matching_rule_wins() -> None:
    rules = RuleSet((Rule(r"a\..*", 1), Rule(r"a\.b", 0)), "test")
    assert rules.split_for("a.b") == 1
    assert rules.split_for("zzz") is None


def test_rule_pattern_must_match_whole_name() -> None:
    assert not Rule("norm", None).matches("model.norm.weight")
    assert Rule(r".*norm.*", None).matches("model.norm.weight")


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "rules.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_rules_file_with_use_preset_overrides_then_falls_back(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        {"rules": [{"pattern": r"lm_head\.weight", "split": "replicate"}], "use_preset": True},
    )
    rules = resolve_rules(path, "LlamaForCausalLM")
    assert rules.split_for("lm_head.weight") is None
    assert rules.split_for("model.layers.0.mlp.down_proj.weight") == 1
    assert str(path) in rules.source and "preset:LlamaForCausalLM" in rules.source


def test_rules_file_alone_replaces_preset(tmp_path: Path) -> None:
    path = _write(tmp_path, {"rules": [{"pattern": ".*", "split": 0}]})
    rules = resolve_rules(path, "LlamaForCausalLM")
    assert rules.split_for("model.norm.weight") == 0


def test_rules_file_changes_plan(tiny_llama: Path, tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        {"rules": [{"pattern": r"model\.embed_tokens\.weight", "split": 1}], "use_preset": True},
    )
    plan = plan_shards(tiny_llama, 2, rules=path)
    assert plan.split_dim("model.embed_tokens.weight") == 1
    assert plan.split_dim("lm_head.weight") == 0


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{", "not valid JSON"),
        ({"rules": [{"pattern": "a", "split": 2}]}, "rules.0.split"),
        ({"rules": [{"pattern": "a", "split": True}]}, "rules.0.split"),
        ({"rules": [{"pattern": "a", "split": "0"}]}, "rules.0.split"),
        ({"rules": [{"pattern": "(", "split": 0}]}, "not a valid regular expression"),
        ({"rules": [{"pattern": "a", "split": 0, "dim": 1}]}, "rules.0.dim"),
        ({"rules": [], "preset": "llama"}, "preset"),
        ({}, "rules"),
        ([], "top level"),
        ([{"pattern": "a", "split": 0}], r'must be an object: \{"rules": \['),
        ("[" * 100_000, "nested too deeply"),
    ],
    ids=["json", "split-2", "split-bool", "split-str", "regex", "extra-key", "top-extra",
         "no-rules", "list", "list-of-rules", "deep"],
)  # fmt: skip
def test_invalid_rules_file_names_file_and_problem(
    tmp_path: Path, content: object, match: str
) -> None:
    path = _write(tmp_path, content)
    with pytest.raises(ConfigError, match=match) as info:
        load_rules_file(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_user_rule_matching_no_tensor_is_warned_and_reported(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(
        tmp_path,
        {
            "rules": [{"pattern": "q_proj", "split": 0}, {"pattern": ".*k_proj.*", "split": 0}],
            "use_preset": True,
        },
    )
    with caplog.at_level(logging.WARNING, logger="rayload.loading.plan"):
        plan = plan_shards(tiny_llama, 2, rules=path)
    assert plan.unused_rules == ("q_proj",)
    [record] = caplog.records
    assert "rule 'q_proj' matches no tensor" in record.getMessage()
    assert "must match the whole tensor name (e.g. '.*q_proj.*'" in record.getMessage()


def test_preset_rules_matching_nothing_are_not_reported(tiny_llama: Path) -> None:
    assert plan_shards(tiny_llama, 2).unused_rules == ()


def test_missing_rules_file_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_rules(tmp_path / "absent.json", "LlamaForCausalLM")


def test_use_preset_without_preset_is_config_error(tmp_path: Path) -> None:
    path = _write(tmp_path, {"rules": [], "use_preset": True})
    with pytest.raises(ConfigError, match="no preset for architecture GPT2"):
        resolve_rules(path, "GPT2")


def test_rule_round_trips_through_spec() -> None:
    for rule in PRESETS["LlamaForCausalLM"]:
        assert Rule.from_spec(rule.to_spec()) == rule
    assert RulesFile(rules=[r.to_spec() for r in PRESETS["Qwen2ForCausalLM"]]).use_preset is False


def test_bad_rule_object_is_config_error() -> None:
    with pytest.raises(ConfigError, match="split must be"):
        Rule("a", 2)
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        Rule("(", 0)
