"""Loads from a real S3-protocol server on the package's Ray cluster (moto behind the
counting proxy of tests/support/s3.py; the rank actors read the AWS environment they
inherited as their node's, never from an argument).

* a TP forward over shards fetched from ``s3://`` equals transformers' logits;
* 3 replicas of TP=2: the server's own byte count is one replica's with peers, three
  times it without (method ``scratch`` reads storage on every replica);
* the secret access key (a canary) reaches no output, trace file, Ray log, nor Ray's
  state API;
* an endpoint silent after the driver's reads is each rank's StorageError, within the
  load's timeout;
* a Serve replica of examples/serve_deployment.py loads from ``s3://`` and answers a POST
  with transformers' top 5, the canary nowhere in Serve's or Ray's state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import ray
import torch
from ray import serve
from ray.util.state import list_actors, list_tasks

import rayload
from rayload.actors.messages import RankState
from rayload.errors import StorageError
from rayload.loading import plan_shards, write_checkpoint
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.identity import SAMPLE_BYTES, peer_key
from rayload.loading.methods import LoadMethod
from rayload.models import build_model
from support.group_ranks import group_bytes
from support.s3 import CANARY, S3Server, data_start, files_containing, s3_server
from support.transformers_models import Reference, reference_logits

pytestmark = pytest.mark.usefixtures("ray_cluster")

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def s3() -> S3Server:
    return s3_server()


def _forward(state: RankState, input_ids: torch.Tensor) -> dict[str, Any]:
    with torch.no_grad():
        return {"rank": state.rank, "logits": state.model(input_ids)}


def test_tp_forward_over_shards_from_s3_equals_transformers(
    s3: S3Server, reference: Callable[[str], Reference], no_leaks: Any
) -> None:
    """The load, then a reload in place from the same prefix: each rank reads only its
    byte ranges (the driver hands it the opened checkpoint: the server sees the headers
    read once per load, by the driver), the group fetches each split-1 tensor once, and
    the forward equals transformers' both times."""
    ref = reference("llama_gqa")
    url = s3.upload(ref.path, "ray-models", "llama-gqa")
    files = sorted(ref.path.glob("*.safetensors"))
    plan = plan_shards(open_checkpoint(ref.path), 2)
    with rayload.load(url, tp_size=2, device="cpu", model=build_model, timeout=180) as result:
        assert [r.storage for r in result.ranks] == ["s3", "s3"]
        assert all(r.method.effective is LoadMethod.SCRATCH for r in result.ranks)
        outputs = [result.apply(_forward, ref.input_ids)]
        s3.proxy.clear()
        result.reload(timeout=180)
        outputs.append(result.apply(_forward, ref.input_ids))
        gets = [r for r in s3.proxy.requests("ray-models/llama-gqa/") if r.method == "GET"]
        header_gets = [
            r
            for r in gets
            for f in files
            if r.key.endswith(f.name)
            and int((r.range or "bytes=0-").removeprefix("bytes=").partition("-")[0])
            < data_start(f)
        ]
        assert len(header_gets) == 2 * len(files), header_gets  # the driver's, 8 B + header
        # The ranks shared their split-1 tensors (the load's gloo group): each fetched once.
        data = sum(
            r.body_bytes for r in gets if r not in header_gets and r.key.endswith(".safetensors")
        )
        assert data == sum(r.bytes_read for r in result.ranks) == group_bytes(plan)
        assert data < 1.01 * plan.checkpoint_bytes
    for output in (o for each in outputs for o in each):
        diff = (output["logits"] - ref.logits).abs().max().item()
        assert diff <= 1e-4, f"rank {output['rank']}: max |diff| {diff}"


@pytest.fixture(scope="module")
def medium_url(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """A 16 MB checkpoint in S3 (its fixed reads, headers and identity samples, are small
    beside it) and its size in bytes."""
    path = write_checkpoint(tmp_path_factory.mktemp("s3-medium") / "ckpt", size_gb=0.016, seed=3)
    url = s3.upload(path, "ray-models", "medium")
    return url, open_checkpoint(path).total_bytes


def _metadata_served(s3: S3Server, url: str) -> int:
    """Bytes the driver's reads are served, once per load or reload whatever the
    replicas: the headers and config (the peer key of object storage reads nothing)."""
    s3.proxy.clear()
    checkpoint = open_checkpoint(url)
    peer_key(checkpoint, plan_shards(checkpoint, 2))
    return s3.proxy.served_bytes(url.removeprefix("s3://") + "/")


def test_three_replicas_are_served_one_replicas_bytes_with_peers_three_times_without(
    s3: S3Server, medium_url: tuple[str, int], no_leaks: Any
) -> None:
    """3 TP=2 replicas loaded with peers: the server serves one replica's bytes (replica 0
    fetches, the others receive). The same replicas reloaded with ``scratch`` (no peers:
    every replica reads storage, into the same actors): 3.0x. Both by the server's count."""
    url, size = medium_url
    prefix = url.removeprefix("s3://") + "/"
    driver = _metadata_served(s3, url)
    s3.proxy.clear()
    with rayload.load(url, 2, device="cpu", replicas=3, method="auto", timeout=300) as result:
        with_peers, ranks = s3.proxy.served_bytes(prefix), result.ranks
        s3.proxy.clear()
        result.reload(method="scratch", timeout=300)
        without, scratch = s3.proxy.served_bytes(prefix), result.ranks
    receivers = [r for r in ranks if r.replica]
    assert len(receivers) == 4
    assert all(
        r.method.effective is LoadMethod.PEER and r.bytes_from_storage == 0 for r in receivers
    )
    assert all(r.method.effective is LoadMethod.SCRATCH for r in scratch)
    per_replica = [sum(r.bytes_read for r in scratch if r.replica == i) for i in range(3)]
    one = driver + per_replica[0]  # one replica's load, as the server counts it
    assert without - driver == sum(r.bytes_read for r in scratch)  # the server, the ranks agree
    assert len(set(per_replica)) == 1  # every replica fetched the same bytes
    print(
        f"served: one TP=2 replica {one / size:.3f}x the checkpoint (driver {driver} B); "
        f"3 replicas with peers {with_peers / one:.3f}x one replica, without "
        f"{(without - driver) / per_replica[0]:.3f}x its ranks' bytes"
    )
    assert 0 < driver < 0.05 * size
    assert sum(r.bytes_from_storage for r in ranks) == per_replica[0]  # replica 0's only
    assert with_peers <= 1.02 * one
    assert 2.98 * per_replica[0] <= without - driver <= 3.02 * per_replica[0]


def test_the_secret_key_reaches_no_output_trace_log_or_state_api(
    s3: S3Server,
    medium_url: tuple[str, int],
    ray_cluster: Any,
    no_leaks: Any,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    url, _ = medium_url
    with rayload.load(url, 2, device="cpu", trace_dir=tmp_path / "trace") as result:
        assert result.ranks[0].storage == "s3"
        details = [
            *list_actors(address=ray_cluster.state_address, detail=True, limit=10_000),
            *list_tasks(address=ray_cluster.state_address, detail=True, limit=10_000),
        ]
    out = capfd.readouterr()
    assert CANARY not in out.out + out.err
    assert sorted((tmp_path / "trace").iterdir()), "no trace written"
    assert files_containing(tmp_path / "trace", CANARY) == []
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    assert files_containing(session / "logs", CANARY) == []
    assert CANARY not in repr(details)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "list",
            "actors",
            "--detail",
            "--address",
            ray_cluster.state_address,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert cli.returncode == 0 and "RankActor" in cli.stdout, cli.stderr[-2000:]
    assert CANARY not in cli.stdout + cli.stderr


def test_a_serve_replica_loads_from_s3_and_answers_a_post_keeping_the_secret(
    s3: S3Server,
    serve_example: ModuleType,
    ray_cluster: Any,
    serve_instance: Any,
    no_leaks: Any,
    tmp_path: Path,
) -> None:
    local = write_checkpoint(tmp_path / "f32-llama", dtype="f32")
    url = s3.upload(local, "ray-models", "serve-f32-llama")
    token_ids = [7, 300, 42, 5]
    want = reference_logits(local, torch.tensor([token_ids]))[0, -1].topk(5).indices.tolist()
    endpoint = serve_instance.url
    try:
        load = {"path": url, "tp_size": 2, "device": "cpu", "timeout": 180}
        serve.run(serve_example.build_app({"load": load}), name="rayload-s3", route_prefix="/")
        with urllib.request.urlopen(endpoint, timeout=60) as response:
            summary = json.load(response)
        assert [r["storage"] for r in summary["ranks"]] == ["s3", "s3"]
        assert all(r["bytes_from_storage"] > 0 for r in summary["ranks"])
        request = urllib.request.Request(
            endpoint, data=json.dumps({"token_ids": token_ids}).encode()
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.load(response) == {"top5": want}
        state = repr(
            [
                serve.status(),
                *list_actors(address=ray_cluster.state_address, detail=True, limit=10_000),
                *list_tasks(address=ray_cluster.state_address, detail=True, limit=10_000),
            ]
        )
        assert "ServeReplica" in state and "RankActor" in state
        assert CANARY not in state + json.dumps(summary)
    finally:
        serve.delete("rayload-s3")
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    assert files_containing(session / "logs", CANARY) == []


def test_an_endpoint_silent_after_the_headers_is_each_rank_s_storage_error_within_timeout(
    s3: S3Server, medium_url: tuple[str, int], no_leaks: Any, tmp_path: Path
) -> None:
    """The driver reads the headers, then the server answers the ranks' data GETs with
    headers and nothing more: the load ends with the rank's StorageError (exit 2) naming
    rank, node and endpoint, within the load's timeout, and the trace is written; not
    RankTimeoutError (exit 1) after the whole wait."""
    url, _ = medium_url
    timeout = 24
    s3.proxy.clear()
    # Longer than the driver's reads (4 KiB identity samples): the ranks' ranges only.
    s3.proxy.inject("blackhole", times=10_000, min_start=9, min_length=SAMPLE_BYTES + 1)
    start = time.monotonic()
    try:
        with pytest.raises(StorageError) as info:
            rayload.load(url, 2, device="cpu", timeout=timeout, trace_dir=tmp_path / "trace")
        elapsed = time.monotonic() - start
    finally:
        s3.proxy.clear()
    message = str(info.value)
    assert info.value.exit_code == 2 and info.value.rank is not None, message
    assert message.startswith(f"rank {info.value.rank} on node {info.value.node_id}: s3://")
    assert f"within the load's timeout ({timeout} s" in message and "127.0.0.1" in message
    assert elapsed < timeout, elapsed
    assert sorted((tmp_path / "trace").iterdir()), "no trace written"
