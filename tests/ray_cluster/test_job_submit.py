"""examples/job_submit.py (options from ``--config FILE``, a flag overriding it) through
``ray job submit`` against its own ``ray start --head`` cluster, run entirely in
subprocesses (own ports, own temp dir) and stopped by killing only that cluster's
processes: never ``ray stop``, which would stop every Ray on the machine. The job's
next-token top 5 is held to transformers on the same generated checkpoint: once from a
local checkpoint, all of it in job_submit_script.py, a background run started at the
session's start (tests/conftest.py); once from ``s3://`` on the tests' S3 server
(tests/support/s3.py, in this process), whose endpoint and credentials the cluster's
processes have from their environment only."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ray_cluster import job_submit_script
from ray_cluster.job_submit_script import RAY, REPO
from rayload.loading import write_checkpoint
from support.background import BackgroundRuns
from support.s3 import CANARY, files_containing, s3_server
from support.transformers_models import reference_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job_submit_run(background_runs: BackgroundRuns) -> dict[str, Any]:
    """``{"token_ids", "returncode", "stdout", "stderr"}`` of the ``ray job submit``."""
    done = background_runs.result("job_submit_run").run
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@dataclass(frozen=True)
class HeadNode:
    dashboard: str
    env: dict[str, str]
    temp_dir: str


@pytest.fixture
def head_node() -> Iterator[HeadNode]:
    """A one-node cluster of its own (job_submit_script.head_node) in this process's
    environment, so with the tests' AWS variables (tests/conftest.py)."""
    env = job_submit_script.job_env()
    with job_submit_script.head_node(env) as (dashboard, temp_dir):
        yield HeadNode(dashboard, env, temp_dir)


def test_job_submit_example_loads_inside_a_ray_job_and_prints_top5(
    job_submit_run: dict[str, Any], tmp_path: Path
) -> None:
    run = job_submit_run
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    lines = [line for line in run["stdout"].splitlines() if line.startswith('{"trace_id"')]
    assert len(lines) == 1, run["stdout"][-3000:]
    summary = json.loads(lines[0])
    # The config file says tp_size 4, --tp says 2: the flag wins.
    assert summary["tp_size"] == 2 and len(summary["trace_id"]) == 32
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert {r["method"]["requested"] for r in summary["ranks"]} == {"scratch"}
    assert all(r["bytes_read"] > 0 and r["node_id"] for r in summary["ranks"])
    assert "succeeded" in run["stdout"]
    # The job generated this checkpoint in its own temp dir: the writer is deterministic.
    checkpoint = write_checkpoint(tmp_path / "ckpt", dtype="f32")
    logits = reference_logits(checkpoint, torch.tensor([run["token_ids"]]))
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
