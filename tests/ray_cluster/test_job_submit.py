"""examples/job_submit.py (options from ``--config FILE``, a flag overriding it) through
``ray job submit`` against its own ``ray start --head`` cluster, run entirely in
subprocesses (own ports, own temp dir) and stopped by killing only that cluster's
processes: never ``ray stop``, which would stop every Ray on the machine. It all runs in
job_submit_script.py, a background run started at the session's start (tests/conftest.py).
The job's next-token top 5 is held to transformers on the same generated checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rayload.loading import write_checkpoint
from support.background import BackgroundRuns
from support.transformers_models import reference_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job_submit_run(background_runs: BackgroundRuns) -> dict[str, Any]:
    """``{"token_ids", "returncode", "stdout", "stderr"}`` of the ``ray job submit``."""
    done = background_runs.result("job_submit_run").run
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


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
