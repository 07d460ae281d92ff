"""``load_format="rayload"`` with the weights in object storage: a TP 2 engine whose model
is a local directory (config.json, as vLLM needs it) and whose weights are
``model_loader_extra_config={"path": "s3://..."}`` on the tests' real S3 server (moto,
behind the byte-counting proxy; tests/support/s3.py).

vLLM 0.32 refuses an ``s3://`` model for any load format but its own streamers ("To load
a model from object storage ... 'load_format' must be 'modelexpress', 'runai_streamer' or
'runai_streamer_sharded'"), hence ``path``. Each worker reads its own ranges from S3, its
parameters hold the bytes vLLM's own loader leaves from the local copy, and the session's
canary secret appears nowhere in what the engine printed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.model_executor", reason="vLLM is in the vLLM test environment (.venv-vllm) only"
)

from support.s3 import CANARY, s3_server
from support.vllm_engines import EngineRun, run_engine

pytestmark = pytest.mark.slow

TP = 2
BUCKET = "vllm-models"
PREFIX = "llama-gqa"
METADATA_BOUND = 64 * 1024
"""Bytes a worker reads besides its ranges, at most: config.json, a header's 8 bytes and
the header (a few KB here)."""


@dataclass(frozen=True)
class FromS3:
    run: EngineRun
    served: int
    checkpoint_bytes: int
    printed: str


def _run_printing_to(out: int, checkpoint: Path, url: str) -> EngineRun:
    """``run_engine`` with file descriptors 1 and 2 (the workers inherit them) on ``out``."""
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(out, 2)
    try:
        return run_engine(str(checkpoint), TP, "rayload", model_loader_extra_config={"path": url})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved_fd in zip((1, 2), saved, strict=True):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)


@pytest.fixture(scope="module")
def from_s3(vllm_checkpoints: dict[str, Path]) -> FromS3:
    checkpoint = vllm_checkpoints["llama_gqa"]
    server = s3_server()  # sets the session's AWS environment before vLLM's workers spawn
    url = server.upload(checkpoint, BUCKET, PREFIX)
    before = server.proxy.served_bytes(f"{BUCKET}/{PREFIX}/")
    with tempfile.TemporaryFile("w+") as out:
        run = _run_printing_to(out.fileno(), checkpoint, url)
        out.seek(0)
        printed = out.read()
    return FromS3(
        run=run,
        served=server.proxy.served_bytes(f"{BUCKET}/{PREFIX}/") - before,
        checkpoint_bytes=sum(p.stat().st_size for p in checkpoint.iterdir()),
        printed=printed,
    )


def test_vllm_workers_read_only_their_ranges_from_s3_each_split1_tensor_once(
    from_s3: FromS3,
) -> None:
    loads = [w["load"] for w in from_s3.run.workers]
    ranges = sum(load["bytes_read"] for load in loads)
    print(f"measured: {TP} workers' ranges {ranges} B, served {from_s3.served} B (2 loads), "
          f"checkpoint {from_s3.checkpoint_bytes} B")  # fmt: skip
    assert [(load["rank"], load["tp_size"]) for load in loads] == [(0, TP), (1, TP)]
    assert {(load["storage"], load["storage_bucket"]) for load in loads} == {("s3", BUCKET)}
    # The workers share their split-1 tensors over vLLM's TP group: each is fetched once,
    # whole, by one worker, which scatters the other's columns. So the workers fetch
    # exactly their shards' bytes between them (fetching split-1 rows as runs, they fetched
    # more): the checkpoint's tensors once, plus what both hold whole.
    assert ranges == sum(load["shard_bytes"] for load in loads)
    assert all(load["bytes_read"] > 0 for load in loads)
    assert ranges < TP * from_s3.checkpoint_bytes
    # Two loads (the engine's, then the probe's fresh copy), each the workers' bytes plus
    # per worker config.json and the header; each worker reading the whole file would be
    # TP times the checkpoint per load.
    assert 2 * ranges <= from_s3.served <= 2 * (ranges + TP * METADATA_BOUND)
    assert len(from_s3.run.tokens) == 4


def test_weights_from_s3_equal_vllms_own_load_of_the_local_copy(from_s3: FromS3) -> None:
    for worker in from_s3.run.workers:
        compare = worker["compare"]
        assert compare["auto_names"] == compare["rayload_names"]
        assert compare["differ"] == [] and compare["nan_left"] == []


def test_the_secret_is_nowhere_in_what_the_engine_printed(from_s3: FromS3) -> None:
    assert "Loading weights took" in from_s3.printed and "from s3" in from_s3.printed
    assert CANARY not in from_s3.printed
