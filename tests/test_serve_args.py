"""rayload.serve's typed application args without a cluster: the nested form of a config
file, the dotted ``key=value`` form of ``serve run module:app``, and one line for a bad
value, as Serve's deploy error and as ``serve run``'s exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rayload import LoadConfig
from rayload.errors import ConfigError
from rayload.serve import ServeArgs, ServeArgsError, TPReplica, application, deployment_options

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SERVE = str(Path(sys.executable).with_name("serve"))


def test_serve_args_dotted_text_equals_the_nested_typed_form() -> None:
    nested = ServeArgs.of(
        {"load": {"path": "/m", "tp_size": 2, "peers": False, "timeout": 30.0}, "max_replicas": 3}
    )
    dotted = ServeArgs.of(
        {
            "load.path": "/m",
            "load.tp_size": "2",
            "load.peers": "false",
            "load.timeout": "30",
            "max_replicas": "3",
        }
    )
    assert dotted == nested
    assert dotted.load.tp_size == 2 and dotted.load.peers is False


def test_serve_args_dotted_key_overrides_a_field_of_a_given_config() -> None:
    args = ServeArgs.of({"load": LoadConfig(path="/m", tp_size=2), "load.device": "cpu"})
    assert (args.load.path, args.load.tp_size, args.load.device) == ("/m", 2, "cpu")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"load.path": "/m", "load.tp_size": "two"},
            "rayload Serve args: tp_size must be a positive integer, got 'two'",
        ),
        (
            {"path": "/m", "tp_size": 2},
            "rayload Serve args: path is an option of the load: give it as load.path "
            "(or under load: in a config file)",
        ),
        (
            {"load": {"path": "/m", "tp_size": 2}, "max_replica": 2},
            "rayload Serve args: max_replica: no such option (the options are: load, "
            "replicas, max_replicas, cpus_per_bundle)",
        ),
        (
            {"load.path": "/m", "load.tp_size": 2, "load.tpsize": 2},
            "rayload Serve args: load.tpsize: no such option (the options are: "
            + ", ".join(LoadConfig.model_fields)
            + ")",
        ),
    ],
)
def test_bad_serve_args_are_one_line_naming_the_field(
    args: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        ServeArgs.of(args)
    assert str(caught.value) == message


def test_application_of_bad_args_is_a_serve_error_and_a_usage_error() -> None:
    with pytest.raises(ServeArgsError) as caught:
        application(TPReplica, {"load.path": "/m", "load.tp_size": "0"})
    error = caught.value
    assert str(error) == "rayload Serve args: tp_size must be a positive integer, got 0"
    assert error.exit_code == 2  # click's usage error: `serve run` exits 2


def test_deployment_options_size_the_replicas_placement_group() -> None:
    options = deployment_options(ServeArgs.of({"load.path": "/m", "load.tp_size": "2"}))
    assert options["placement_group_bundles"] == [{"CPU": 0.01}] * 3
    assert options["num_replicas"] == 1


def test_serve_run_with_a_bad_key_value_arg_exits_2_with_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [SERVE, "run", "--app-dir", str(EXAMPLES), "serve_deployment:build_app",
         f"load.path={tmp_path}", "load.tp_size=two"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "Error: rayload Serve args: tp_size must be a positive integer, got 'two'"
    )
