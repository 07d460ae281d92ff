"""``rayload convert`` as a user runs it."""

from __future__ import annotations

from pathlib import Path

from rayload.loading.manifest import read_manifest
from support.cli import assert_one_line_error, run_cli


def test_convert_writes_rank_files_and_manifest(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    result = run_cli("convert", str(tiny_llama), str(out), "--tp", "2")
    assert result.returncode == 0, result.stderr
    assert str(out / "rayload-manifest.json") in result.stdout
    manifest = read_manifest(str(out / "rayload-manifest.json"))
    assert manifest.tp_size == 2
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
    ]


def test_convert_with_rules_file(tiny_llama: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text('{"rules": [{"pattern": ".*", "split": "replicate"}]}')
    result = run_cli(
        "convert", str(tiny_llama), str(tmp_path / "o"), "--tp", "2", "--rules", str(rules)
    )
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(str(tmp_path / "o" / "rayload-manifest.json"))
    assert set(manifest.splits.values()) == {None}


def test_convert_into_non_empty_directory_exits_2(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    result = run_cli("convert", str(tiny_llama), str(tmp_path / "busy"), "--tp", "2")
    assert_one_line_error(result, str(tmp_path / "busy"), "not an empty directory")


def test_convert_missing_checkpoint_exits_2(tmp_path: Path) -> None:
    result = run_cli("convert", str(tmp_path / "nope"), str(tmp_path / "out"), "--tp", "2")
    assert_one_line_error(result, str(tmp_path / "nope"))
    assert not (tmp_path / "out").exists()


def test_convert_to_unwritable_output_exits_2(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out"
    result = run_cli("convert", str(tiny_llama), str(out), "--tp", "2")
    assert_one_line_error(result, str(out), "cannot write", "writable directory")


def test_convert_tp_not_dividing_exits_2(tiny_llama: Path, tmp_path: Path) -> None:
    result = run_cli("convert", str(tiny_llama), str(tmp_path / "out"), "--tp", "3")
    assert_one_line_error(result, "not divisible by tp=3")
    assert not (tmp_path / "out").exists()


def test_convert_without_tp_is_a_usage_error(tiny_llama: Path, tmp_path: Path) -> None:
    result = run_cli("convert", str(tiny_llama), str(tmp_path / "out"))
    assert_one_line_error(result, "--tp")
