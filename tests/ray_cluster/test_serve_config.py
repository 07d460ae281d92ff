"""examples/serve_config.yaml through Serve's own command line on the session cluster:
``serve run --non-blocking`` and ``serve deploy`` each bring the application up (two
ranks in the replica's placement group, a POST answered; on the package's one Serve,
``serve_instance``, whose HTTP port the config names); a config whose
``args.load.tp_size`` is bad fails the deploy with one line naming the field, and no
replica or rank actor starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray import serve
from ray.util.state import list_actors

from rayload.loading import write_checkpoint

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SERVE = str(Path(sys.executable).with_name("serve"))
APP = "rayload-example"

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]


@pytest.fixture(scope="module")
def f32_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("serve-yaml") / "ckpt", dtype="f32")


def _config(tmp_path: Path, checkpoint: Path, port: int, **load: Any) -> Path:
    """examples/serve_config.yaml for this cluster: the test's checkpoint and HTTP port,
    ``load`` fields replaced, and the examples on the replicas' PYTHONPATH (as
    ``PYTHONPATH=examples serve run`` gives a local Ray)."""
    config = yaml.safe_load((EXAMPLES / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    app["args"]["load"] |= {"path": str(checkpoint), **load}
    python_path = os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])
    app["runtime_env"] = {"env_vars": {"PYTHONPATH": python_path}}
    path = tmp_path / f"serve-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _serve_cli(*args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([SERVE, *args], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run


def _wait_for(status: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(APP)
        if app is not None and app.status == status:
            return app
        assert time.monotonic() < deadline, f"{APP} not {status}: {app}"
        time.sleep(0.5)


def _answers(url: str) -> None:
    with urllib.request.urlopen(url, timeout=60) as response:
        summary = json.load(response)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    post = urllib.request.Request(url, data=json.dumps({"token_ids": [1, 2, 3]}).encode())
    with urllib.request.urlopen(post, timeout=60) as response:
        assert len(json.load(response)["top5"]) == 5


def _actors(state_address: str, *prefixes: str) -> list[str]:
    alive = list_actors(address=state_address, filters=[("state", "=", "ALIVE")])
    return [a.class_name for a in alive if a.class_name.startswith(prefixes)]


def test_serve_config_yaml_runs_and_deploys_and_a_bad_arg_is_one_deploy_error(
    f32_llama: Path, ray_cluster: Any, serve_instance: Any, tmp_path: Path, no_leaks: object
) -> None:
    url, port = serve_instance.url, serve_instance.port
    gcs = ray.get_runtime_context().gcs_address
    try:
        _serve_cli(
            "run",
            "--address",
            gcs,
            "--non-blocking",
            str(_config(tmp_path, f32_llama, port)),
        )
        _wait_for("RUNNING")
        _answers(url)
        serve.delete(APP)

        bad = _config(tmp_path, f32_llama, port, tp_size="two")
        _serve_cli("deploy", "--address", ray_cluster.state_address, str(bad))
        failed = _wait_for("DEPLOY_FAILED")
        message = failed.message.strip()
        print(f"measured: serve deploy of a bad config: {message}")
        # Serve's own header line, then rayload's one line: no traceback.
        header, reason = message.splitlines()
        assert header.startswith(f"Deploying app '{APP}' failed")
        assert reason == "rayload Serve args: tp_size must be a positive integer, got 'two'"
        assert _actors(ray_cluster.state_address, "ServeReplica", "RankActor") == []

        good = _config(tmp_path, f32_llama, port)
        _serve_cli("deploy", "--address", ray_cluster.state_address, str(good))
        _wait_for("RUNNING")
        _answers(url)
    finally:
        serve.delete(APP)
