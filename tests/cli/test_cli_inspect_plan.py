"""``rayload inspect``, ``plan`` and ``make-checkpoint`` as a user runs them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.plan import plan_shards
from support.cli import assert_one_line_error, run_cli


def test_inspect_json_lists_every_tensor(tiny_llama: Path) -> None:
    result = run_cli("inspect", str(tiny_llama), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    ckpt = open_checkpoint(tiny_llama)
    assert summary["layout"] == "hf_index"
    assert summary["architecture"] == "LlamaForCausalLM"
    assert summary["tensor_bytes"] == ckpt.tensor_bytes
    assert len(summary["files"]) == 2
    by_name = {t["name"]: t for t in summary["tensors"]}
    assert by_name.keys() == ckpt.tensors.keys()
    assert by_name["model.layers.1.mlp.down_proj.weight"]["shape"] == [256, 512]
    assert by_name["model.layers.1.mlp.down_proj.weight"]["bytes"] == 256 * 512 * 2


def test_inspect_table_is_readable(tiny_llama: Path) -> None:
    result = run_cli("inspect", str(tiny_llama))
    assert result.returncode == 0, result.stderr
    assert "hf_index, LlamaForCausalLM" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("lm_head.weight"))
    assert row.split()[1:4] == ["BF16", "512x256", "256.00"]


def test_plan_json_reports_rank_bytes_and_amplification(tiny_llama: Path) -> None:
    result = run_cli("plan", str(tiny_llama), "--tp", "4", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    plan = plan_shards(tiny_llama, 4)
    assert [r["bytes"] for r in summary["ranks"]] == list(plan.rank_bytes)
    assert summary["replicated_bytes"] == plan.replicated_bytes > 0
    assert summary["read_amplification"] == pytest.approx(plan.read_amplification)
    assert summary["unmatched"] == {"count": 0, "bytes": 0, "tensors": []}
    assert summary["rules"] == "preset:LlamaForCausalLM"


def test_plan_shows_unmatched_tensors_with_rules_file(tiny_llama: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"pattern": r".*_proj\.weight", "split": 0}]}))
    result = run_cli("plan", str(tiny_llama), "--tp", "2", "--rules", str(rules))
    assert result.returncode == 0, result.stderr
    assert "unmatched: lm_head.weight" in result.stdout
    assert "unmatched           7 tensors" in result.stdout  # embed, 5 norms, lm_head


def test_plan_warns_about_rule_matching_no_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"pattern": "q_proj", "split": 0}]}))
    result = run_cli("plan", str(tiny_llama), "--tp", "2", "--rules", str(rules))
    assert result.returncode == 0, result.stderr
    assert "warning: rule 'q_proj' matches no tensor" in result.stdout
    result = run_cli("plan", str(tiny_llama), "--tp", "2", "--rules", str(rules), "--json")
    assert json.loads(result.stdout)["unused_rules"] == ["q_proj"]


def test_make_checkpoint_writes_loadable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "m"
    result = run_cli("make-checkpoint", str(out), "--files", "3", "--dtype", "f16", "--seed", "5")
    assert result.returncode == 0, result.stderr
    ckpt = open_checkpoint(out)
    assert len(ckpt.files) == 3
    assert {t.dtype for t in ckpt.tensors.values()} == {"F16"}
    assert str(out) in result.stdout


@pytest.mark.parametrize(
    ("make_args", "needles"),
    [
        (lambda d, t: ["inspect", str(t / "missing")], ["missing", "no such file"]),
        (lambda d, t: ["plan", str(d), "--tp", "3"], ["not divisible by tp=3", "model-0000"]),
        (lambda d, t: ["plan", str(d), "--tp", "0"], ["tp_size"]),
        (lambda d, t: ["plan", str(d), "--tp", "2", "--rules", str(t / "r.json")], ["r.json"]),
        (lambda d, t: ["make-checkpoint", str(d)], ["already holds a checkpoint"]),
        (lambda d, t: ["make-checkpoint", str(t / "x"), "--files", "999"], ["num_files"]),
        (lambda d, t: ["make-checkpoint", str(t / "x"), "--size-gb", "-1"], ["size_gb"]),
    ],
    ids=["missing", "indivisible", "tp0", "rules-missing", "exists", "files", "size"],
)
def test_bad_input_exits_2_with_one_line(
    tiny_llama: Path,
    tmp_path: Path,
    make_args: Callable[[Path, Path], list[str]],
    needles: list[str],
) -> None:
    assert_one_line_error(run_cli(*make_args(tiny_llama, tmp_path)), *needles)


def test_make_checkpoint_to_unwritable_output_exits_2(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "mk"
    assert_one_line_error(run_cli("make-checkpoint", str(out)), str(out), "cannot write")


def test_corrupt_header_exits_2_naming_file(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path]
) -> None:
    bad = write_raw_safetensors(tmp_path / "model.safetensors", {"w": {"dtype": "F32"}})
    assert_one_line_error(run_cli("inspect", str(tmp_path)), str(bad), "'w'")


@pytest.mark.parametrize("command", ["inspect", "plan"])
@pytest.mark.parametrize("architectures", ["5", '"LlamaForCausalLM"'])
def test_bad_architectures_in_config_exits_2_naming_config(
    tiny_llama: Path, tmp_path: Path, command: str, architectures: str
) -> None:
    root = tmp_path / "c"
    shutil.copytree(tiny_llama, root)
    (root / "config.json").write_text(f'{{"architectures": {architectures}}}')
    args = [command, str(root)] + (["--tp", "2"] if command == "plan" else [])
    assert_one_line_error(run_cli(*args), str(root / "config.json"), "'architectures'")


def test_inspect_and_plan_of_converted_checkpoint(
    tiny_llama: Path,
    make_converted: Callable[[Path, Path, int], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rayload.cli import main

    out = make_converted(tiny_llama, tmp_path / "tp2", 2)
    assert main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["layout"] == "converted" and summary["tp_size"] == 2
    assert {t["rank"] for t in summary["tensors"]} == {0, 1}
    assert main(["plan", str(out), "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert "(converted), tp=2, rules: manifest" in text
    assert main(["plan", str(out), "--tp", "4"]) == 2
    assert "converted for tp_size=2, not 4" in capsys.readouterr().err
