"""LoadConfig: one field per option of a load, each with its type, default and doc; the
same one message for a bad value as the API's; a config accepted by ``rayload.load``; the
table of options in docs/design.md is the one the fields make."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

import rayload
from rayload.cli.config import options_table
from rayload.config import LoadConfig, config_from_file
from rayload.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_every_field_has_a_one_line_doc_and_a_default_unless_path_or_tp_size() -> None:
    for name, field in LoadConfig.model_fields.items():
        assert field.description and "\n" not in field.description, name
        assert field.is_required() == (name in {"path", "tp_size"}), name


def test_config_is_frozen_and_forbids_unknown_options() -> None:
    config = LoadConfig(path="m", tp_size=2)
    with pytest.raises(ValidationError):
        config.tp_size = 4  # type: ignore[misc]
    with pytest.raises(ConfigError, match="tp_sise: no such option"):
        LoadConfig.of("m", tp_size=2, tp_sise=4)


def test_path_keeps_an_s3_url_as_written() -> None:
    assert LoadConfig.of("s3://bucket/models/llama", tp_size=2).path == "s3://bucket/models/llama"
    assert LoadConfig.of(Path("rel/dir"), tp_size=2).path == "rel/dir"  # not resolved here


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("tp_size", 0, "tp_size must be a positive integer, got 0"),
        ("tp_size", "2", "tp_size must be a positive integer, got '2'"),
        ("device", "tpu", "device must be one of auto, cpu, cuda, got 'tpu'"),
        ("model_role", "critic", "model_role must be one of main, draft, got 'critic'"),
        ("timeout", 0, "timeout must be > 0 seconds, got 0"),
        ("replicas", 0, "replicas must be a positive integer, got 0"),
        ("peers", "yes", "peers must be True or False, got 'yes'"),
        ("process_group", "mpi", "process_group must be one of auto, gloo, nccl or None"),
    ],
)
def test_bad_value_is_one_message(option: str, value: object, message: str) -> None:
    fields = {"tp_size": 2, option: value}
    with pytest.raises(ConfigError) as info:
        LoadConfig.of("m", **fields)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_two_bad_values_are_one_line_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        LoadConfig.of("m", tp_size=0, device="tpu")
    assert str(info.value) == (
        "tp_size must be a positive integer, got 0; device must be one of auto, cpu, cuda, "
        "got 'tpu'"
    )


def test_replace_validates_again() -> None:
    config = LoadConfig(path="m", tp_size=2, replicas=2)
    assert config.replace(method="scratch").replicas == 2
    with pytest.raises(ConfigError, match="unknown load method 'bogus'"):
        config.replace(method="bogus")


def test_load_takes_a_config_and_rejects_a_bad_one_before_ray(tiny_llama: Path) -> None:
    config = LoadConfig(path=str(tiny_llama), tp_size=2, device="cpu")
    with pytest.raises(ConfigError, match="timeout must be > 0"):
        rayload.load(config, timeout=-1)
    with pytest.raises(ConfigError, match="no such option"):
        rayload.load(str(tiny_llama), 2, replica=2)


def test_config_file_yaml_and_json_with_overrides(tmp_path: Path) -> None:
    yaml_file = tmp_path / "load.yaml"
    yaml_file.write_text("path: /models/llama\ntp_size: 4\nmethod: scratch\nreplicas: 2\n")
    config = config_from_file(yaml_file, {"replicas": 3})
    assert (config.path, config.tp_size, config.method.value, config.replicas) == (
        "/models/llama",
        4,
        "scratch",
        3,
    )
    json_file = tmp_path / "load.json"
    json_file.write_text(json.dumps({"path": "s3://b/p", "tp_size": 2, "peers": False}))
    assert config_from_file(json_file).peers is False


def test_bad_value_in_a_file_names_the_file_and_field_but_not_for_an_override(
    tmp_path: Path,
) -> None:
    path = tmp_path / "load.yaml"
    path.write_text("path: m\ntp_size: two\n")
    with pytest.raises(ConfigError) as info:
        config_from_file(path)
    assert str(info.value) == f"{path}: tp_size must be a positive integer, got 'two'"
    with pytest.raises(ConfigError) as info:
        config_from_file(path, {"tp_size": 0})
    assert str(info.value) == "tp_size must be a positive integer, got 0"


@pytest.mark.parametrize(
    ("text", "reason"),
    [("- 1\n- 2\n", "expected a mapping"), ("path: [\n", "not a YAML or JSON file")],
)
def test_a_file_that_is_no_mapping_is_one_line_naming_it(
    tmp_path: Path, text: str, reason: str
) -> None:
    path = tmp_path / "load.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config_from_file(path)
    assert str(info.value).startswith(f"{path}: {reason}") and "\n" not in str(info.value)


def test_docs_show_the_options_table_the_fields_make() -> None:
    """docs/design.md holds ``rayload config``'s table verbatim: the fields are its source."""
    assert options_table() in (DOCS / "design.md").read_text()


def test_load_rank_takes_the_rank_fields_of_a_config(tiny_llama: Path) -> None:
    from rayload.loading import load_rank

    config = LoadConfig(path=str(tiny_llama), tp_size=2, method="scratch", device="cpu")
    tensors, report = load_rank(rank=1, **config.rank_options())
    expected, _ = load_rank(tiny_llama, 1, 2, "scratch", "cpu")
    assert report.rank == 1 and report.method.effective.value == "scratch"
    assert tensors.keys() == expected.keys()
    assert all(tensors[name].equal(expected[name]) for name in expected)


def test_a_config_files_relative_paths_are_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    file = tmp_path / "conf" / "load.yaml"
    file.write_text("path: ../models/llama\ntp_size: 2\nrules: rules.json\ntrace_dir: traces\n")
    monkeypatch.chdir(tmp_path)  # not the file's directory
    config = config_from_file(file)
    assert config.path == str(tmp_path / "conf" / ".." / "models" / "llama")
    assert config.rules == str(tmp_path / "conf" / "rules.json")
    assert config.trace_dir == str(tmp_path / "conf" / "traces")
    # a flag's relative path is the user's, relative to where they run; s3:// stays a URL
    assert config_from_file(file, {"path": "here"}).path == "here"
    file.write_text("path: s3://bucket/llama\ntp_size: 2\n")
    assert config_from_file(file).path == "s3://bucket/llama"
