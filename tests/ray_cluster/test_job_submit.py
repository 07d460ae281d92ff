"""examples/job_submit.py (options from ``--config FILE``, a flag overriding it) through
``ray job submit`` against its own ``ray start --head`` cluster, run entirely in
subprocesses (own ports, own temp dir) and stopped by killing only that cluster's
processes: never ``ray stop``, which would stop every Ray on the machine.
The job's next-token top 5 is held to transformers on the same generated checkpoint; once
from a local checkpoint, once from ``s3://`` on the tests' S3 server (tests/support/s3.py),
whose endpoint and credentials the cluster's processes have from their environment only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from rayload.loading import write_checkpoint
from support.s3 import CANARY, files_containing, s3_server
from support.transformers_models import reference_logits

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class HeadNode:
    dashboard: str
    env: dict[str, str]
    temp_dir: str


def _free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _processes_using(temp_dir: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _wait_for_dashboard(url: str, head: subprocess.Popen[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise AssertionError(f"ray start exited with {head.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise AssertionError(f"the dashboard at {url} did not come up in {timeout_s:.0f} s")


@pytest.fixture
def head_node() -> Iterator[HeadNode]:
    """A one-node cluster from ``ray start --head --block``, token auth off for it and its
    clients (``RAY_AUTH_MODE=disabled``, set alike for ``ray start`` and ``ray job``)."""
    temp_dir = tempfile.mkdtemp(prefix="rl-job-", dir="/tmp")
    gcs, dashboard, client, agent, agent_grpc, metrics, runtime_env = _free_ports(7)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_MODE"] = "disabled"
    # The job's entrypoint runs `python`: make it this virtualenv's, as an activated
    # environment would, even when the tests run as .venv/bin/python without activation.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    command = [
        RAY, "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1",
        "--port", str(gcs),
        "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard),
        "--ray-client-server-port", str(client),
        "--dashboard-agent-listen-port", str(agent),
        "--dashboard-agent-grpc-port", str(agent_grpc),
        "--metrics-export-port", str(metrics),
        "--runtime-env-agent-port", str(runtime_env),
        "--num-cpus", "2",
        "--temp-dir", temp_dir,
    ]  # fmt: skip
    head = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    url = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_dashboard(url, head, timeout_s=120)
        yield HeadNode(dashboard=url, env=env, temp_dir=temp_dir)
    finally:
        head.send_signal(signal.SIGINT)  # `ray start --block` stops its processes on ^C
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)
        leftovers = _processes_using(temp_dir)
        for proc in leftovers:
            proc.kill()
        psutil.wait_procs(leftovers, timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submit_example_loads_inside_a_ray_job_and_prints_top5(
    head_node: HeadNode, tmp_path: Path
) -> None:
    token_ids = [7, 300, 42, 5]
    # The load's options from a config file (the job runs on this machine: it reads it),
    # --tp overriding the file's tp_size.
    config = tmp_path / "load.yaml"
    config.write_text("tp_size: 4\nmethod: scratch\ndevice: cpu\n")
    submit = [
        RAY, "job", "submit",
        "--address", head_node.dashboard,
        "--working-dir", str(REPO / "examples"),
        "--", "python", "job_submit.py", "--config", str(config), "--tp", "2",
        "--token-ids", *map(str, token_ids),
    ]  # fmt: skip
    run = subprocess.run(submit, env=head_node.env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith('{"trace_id"')]
    assert len(lines) == 1, run.stdout[-3000:]
    summary = json.loads(lines[0])
    assert summary["tp_size"] == 2 and len(summary["trace_id"]) == 32
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert {r["method"]["requested"] for r in summary["ranks"]} == {"scratch"}
    assert all(r["bytes_read"] > 0 and r["node_id"] for r in summary["ranks"])
    assert "succeeded" in run.stdout
    # The job generated this checkpoint in its own temp dir: the writer is deterministic.
    checkpoint = write_checkpoint(tmp_path / "ckpt", dtype="f32")
    logits = reference_logits(checkpoint, torch.tensor([token_ids]))
    assert summary["top5"] == logits[0, -1].topk(5).indices.tolist()


def test_job_submit_example_loads_an_s3_checkpoint_with_credentials_from_the_environment(
    head_node: HeadNode, tmp_path: Path
) -> None:
    # ray start inherited the tests' AWS environment (tests/conftest.py): the ranks and the
    # job read it as their node's; nothing about S3 is passed to the job.
    assert head_node.env["AWS_SECRET_ACCESS_KEY"] == CANARY
    checkpoint = write_checkpoint(tmp_path / "ckpt", dtype="f32")
    url = s3_server().upload(checkpoint, "jobs", "tiny-llama-f32")
    token_ids = [7, 300, 42, 5]
    submit = [
        RAY, "job", "submit",
        "--address", head_node.dashboard,
        "--working-dir", str(REPO / "examples"),
        "--", "python", "job_submit.py", "--checkpoint", url, "--tp", "2",
        "--token-ids", *map(str, token_ids),
    ]  # fmt: skip
    run = subprocess.run(submit, env=head_node.env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith('{"trace_id"')]
    assert len(lines) == 1, run.stdout[-3000:]
    summary = json.loads(lines[0])
    assert [(r["rank"], r["storage"]) for r in summary["ranks"]] == [(0, "s3"), (1, "s3")]
    assert all(r["bytes_from_storage"] > 0 for r in summary["ranks"])
    logits = reference_logits(checkpoint, torch.tensor([token_ids]))
    assert summary["top5"] == logits[0, -1].topk(5).indices.tolist()
    state = subprocess.run(
        [RAY, "list", "actors", "--detail", "--address", head_node.dashboard],
        env=head_node.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert state.returncode == 0 and "RankActor" in state.stdout, state.stderr[-2000:]
    assert CANARY not in run.stdout + run.stderr + state.stdout + state.stderr
    assert files_containing(Path(head_node.temp_dir), CANARY) == []
