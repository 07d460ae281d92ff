"""``rayload load``'s flags are LoadConfig's fields (one flag each, the field's doc and
default in its help, and no flag without a field); ``--config FILE`` reads YAML or JSON,
flags override it, a bad value in it is exit 2 with one line naming the file and the field;
``rayload config --schema`` prints the JSON schema."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import ray

from rayload.cli import build_parser, main
from rayload.cli.fields import choices, shown_default
from rayload.cli.load import load_config
from rayload.config import LoadConfig
from support.cli import assert_one_line_error, run_cli

NOT_FIELDS = {"help", "config", "json", "func"}
"""``rayload load``'s arguments that are about the command, not the load."""


def _load_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["load"]


def test_each_field_has_exactly_one_flag_with_its_doc_and_default_and_each_flag_a_field() -> None:
    parser = _load_parser()
    actions = [a for a in parser._actions if a.dest not in NOT_FIELDS]
    assert sorted(a.dest for a in actions) == sorted(LoadConfig.model_fields)
    for action in actions:
        field = LoadConfig.model_fields[action.dest]
        shown = parser._get_formatter()._expand_help(action)
        assert field.description and shown.startswith(field.description), action.dest
        if field.annotation is bool:
            default = action.option_strings[0 if field.default else 1]
            assert f"default: {default}" in shown, (action.dest, shown)
        elif not field.is_required() and field.default is not None:
            assert f"default: {shown_default(field)}" in shown, (action.dest, shown)
        for value in choices(action.dest) or ():
            assert value in shown, (action.dest, value)


def test_flags_not_given_leave_the_fields_default(tiny_llama: Path) -> None:
    args = build_parser().parse_args(["load", str(tiny_llama), "--tp", "2"])
    assert load_config(args) == LoadConfig(path=str(tiny_llama), tp_size=2)


def test_every_flag_reaches_its_field() -> None:
    argv = [
        "load", "ckpt", "--tp", "4", "--method", "scratch", "--device", "cpu",
        "--strict-method", "--rules", "r.json", "--expert-parallel",
        "--process-group", "none", "--address", "local", "--placement-strategy", "SPREAD",
        "--trace-dir", "t", "--otlp-endpoint", "http://x/v1/traces", "--timeout", "30",
        "--model-role", "draft", "--replicas", "2", "--no-peers", "--peer-fanout", "1",
        "--shared-copy",
    ]  # fmt: skip
    config = load_config(build_parser().parse_args(argv))
    assert config.model_dump(mode="json") == {
        "path": "ckpt", "tp_size": 4, "method": "scratch", "device": "cpu", "strict": True,
        "rules": "r.json", "expert_parallel": True, "process_group": None,
        "address": "local", "placement_strategy": "SPREAD", "trace_dir": "t",
        "otlp_endpoint": "http://x/v1/traces", "timeout": 30.0, "model_role": "draft",
        "replicas": 2, "peers": False, "peer_fanout": 1, "shared_copy": True,
    }  # fmt: skip


def test_config_file_gives_the_options_and_flags_override_it(tmp_path: Path) -> None:
    file = tmp_path / "load.yaml"
    file.write_text("path: /models/llama\ntp_size: 4\npeers: false\nreplicas: 3\n")
    args = build_parser().parse_args(["load", "--config", str(file), "--replicas", "2", "--peers"])
    config = load_config(args)
    assert (config.path, config.tp_size, config.replicas, config.peers) == (
        "/models/llama",
        4,
        2,
        True,
    )


def test_bad_value_in_config_file_exits_2_naming_file_and_field_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "load.yaml"
    file.write_text("path: /models/llama\ntp_size: two\n")
    ray_was_up = ray.is_initialized()
    assert main(["load", "--config", str(file)]) == 2
    err = capsys.readouterr().err
    assert err == f"rayload: error: {file}: tp_size must be a positive integer, got 'two'\n"
    assert ray.is_initialized() == ray_was_up


def test_unknown_field_in_a_json_config_file_is_one_line(tmp_path: Path) -> None:
    file = tmp_path / "load.json"
    file.write_text(json.dumps({"path": "m", "tp_size": 2, "replica": 2}))
    assert_one_line_error(run_cli("load", "--config", str(file)), str(file), "replica: no such")


def test_without_dir_and_tp_and_config_exits_2_naming_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["load"]) == 2
    assert capsys.readouterr().err == (
        "rayload: error: give DIR and --tp (or --config FILE holding them)\n"
    )


def test_config_schema_is_the_models_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == LoadConfig.model_json_schema()
    assert schema["required"] == ["path", "tp_size"] and not schema["additionalProperties"]
    assert set(schema["properties"]) == set(LoadConfig.model_fields)
