"""``rayload load`` rejects bad input with exit code 2 and one line on stderr, before any
Ray is started. (Loads that reach Ray are tested in tests/ray_cluster/test_cli_load.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from rayload.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "2"], "no such checkpoint"),
        (["--tp", "0"], "tp_size must be a positive integer, got 0"),
        (["--tp", "2", "--method", "teleport"], "unknown load method 'teleport'"),
        (["--tp", "2", "--timeout", "0"], "timeout must be > 0"),
        (["--tp", "2", "--replicas", "0"], "replicas must be a positive integer, got 0"),
        (["--tp", "2", "--replicas", "-3", "--no-peers"], "replicas must be a positive integer"),
    ],
)
def test_load_bad_input_exits_2_with_one_line_before_ray_starts(
    argv: list[str],
    message: str,
    tiny_llama: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = tmp_path / "missing" if message == "no such checkpoint" else tiny_llama
    ray_was_up = ray.is_initialized()
    assert main(["load", str(target), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert ray.is_initialized() == ray_was_up


def test_load_bad_rules_file_exits_2_naming_it_before_ray_starts(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text('{"rules": [{"pattern": "(", "split": 0}]}')
    ray_was_up = ray.is_initialized()
    assert main(["load", str(tiny_llama), "--tp", "2", "--rules", str(rules)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(rules) in err and "not a valid regular expression" in err
    assert ray.is_initialized() == ray_was_up


def test_load_tp_not_dividing_checkpoint_exits_2_naming_tensor(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["load", str(tiny_llama), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model." in err


def test_load_unknown_placement_strategy_is_usage_error(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["load", str(tiny_llama), "--tp", "2", "--placement-strategy", "RANDOM"])
    assert exited.value.code == 2
    assert "--placement-strategy" in capsys.readouterr().err


def test_load_unreachable_address_exits_2_in_seconds(tiny_llama: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["load", str(tiny_llama), "--tp", "1", "--address", f"127.0.0.1:{port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # A fresh process: one that already has a Ray would use it and ignore --address.
    run = subprocess.run(
        [sys.executable, "-m", "rayload.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr == (
        f"rayload: error: cannot reach a Ray cluster at 127.0.0.1:{port} (from --address / "
        f"address=): Connection refused; start it with `ray start --head --port {port}`, pass "
        "the right --address, or pass --address local (address='local') for a fresh local Ray\n"
    )
