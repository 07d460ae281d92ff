"""Faults and bad input against the real S3 server, injected by the test proxy
(tests/support/s3.py): each is retried to a bit-identical load, or is one clear error
naming the bucket, key and endpoint; a credential never appears."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rayload.cli import main
from rayload.errors import StorageError
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.identity import checkpoint_identity
from rayload.loading.rank import load_rank, reload_rank
from support.cli import assert_one_line_error
from support.s3 import ACCESS_KEY, CANARY, ENDPOINT, S3Server, data_start, rewrite


@pytest.fixture
def fresh(s3: S3Server, tiny_llama: Path, request: pytest.FixtureRequest) -> tuple[str, Path]:
    """A copy of the tiny Llama of its own (a test may rewrite it) and its first file."""
    url = s3.upload(tiny_llama, "models", f"faults/{request.node.name}")
    return url, sorted(tiny_llama.glob("*.safetensors"))[0]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("kind", ["slowdown", "reset", "short"])
def test_throttling_and_cut_bodies_are_retried_to_a_bit_identical_load(
    fresh: tuple[str, Path], tiny_llama: Path, proxy: Any, kind: str
) -> None:
    url, first = fresh
    want, _ = load_rank(tiny_llama, 1, 2)
    proxy.inject(kind, suffix=first.name, times=2, min_start=data_start(first))
    got, report = load_rank(url, 1, 2)
    _assert_equal(got, want)
    assert report.retries >= 2, report
    faulted = [r for r in proxy.requests() if r.key.endswith(first.name) and r.status == 503]
    assert len(faulted) == (2 if kind == "slowdown" else 0)


def test_a_server_ignoring_range_is_refused_before_its_body_is_read(
    fresh: tuple[str, Path], proxy: Any
) -> None:
    url, first = fresh
    proxy.inject("ignore_range", suffix=first.name, times=100, min_start=data_start(first))
    with pytest.raises(StorageError, match="ignored the byte range") as info:
        load_rank(url, 0, 2)
    assert first.name in str(info.value) and "127.0.0.1" in str(info.value)


def test_an_object_changed_after_its_header_was_read_is_an_error_naming_the_key(
    fresh: tuple[str, Path], proxy: Any
) -> None:
    url, first = fresh
    proxy.inject("rewrite", suffix=first.name, min_start=data_start(first))
    with pytest.raises(StorageError, match="changed after its header was read") as info:
        load_rank(url, 0, 2)
    assert f"{url}/{first.name}" in str(info.value)


def test_reload_of_an_object_changed_mid_read_is_an_error_never_two_versions(
    fresh: tuple[str, Path], proxy: Any
) -> None:
    url, first = fresh
    tensors, _ = load_rank(url, 0, 2)
    proxy.inject("rewrite", suffix=first.name, min_start=data_start(first))
    with pytest.raises(StorageError, match="changed after its header was read") as info:
        reload_rank(url, 0, 2, tensors)
    assert first.name in str(info.value)
    # The next reload reads the new version, whole.
    reload_rank(url, 0, 2, tensors)


def test_a_rank_given_the_drivers_checkpoint_refuses_an_object_changed_since(
    fresh: tuple[str, Path], s3: S3Server, proxy: Any
) -> None:
    """What a load request carries (the driver's opened checkpoint, with each object's
    ETag) and its ranks read from: an object rewritten between the driver's read and a
    rank's is an error naming it, never a rank loading another version than the driver
    planned (and than the other ranks)."""
    url, first = fresh
    checkpoint = open_checkpoint(url)  # the driver
    changed = f"{url}/{first.name}"
    assert changed in checkpoint.versions and f"{url}/config.json" in checkpoint.versions
    rewrite(s3.client, *changed.removeprefix("s3://").split("/", 1))
    with pytest.raises(StorageError, match="changed after its header was read") as info:
        load_rank(url, 0, 2, checkpoint=checkpoint)  # the rank, from the request
    assert changed in str(info.value) and checkpoint.versions[changed][1] in str(info.value)
    load_rank(url, 0, 2)  # opening it afresh: the new version, whole


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rayload.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env},
    )


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``rayload ARGS`` in this process (what its exit code and output would be)."""
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def test_missing_bucket_key_and_prefix_exit_2_naming_them_and_the_endpoint(
    fresh: tuple[str, Path], proxy: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = fresh
    result = _main(capsys, "inspect", "s3://no-such-bucket/llama")
    assert_one_line_error(result, "no-such-bucket", "127.0.0.1")
    result = _main(capsys, "plan", f"{url}/absent.safetensors", "--tp", "2")
    assert_one_line_error(result, "'models'", "absent.safetensors", ENDPOINT)
    result = _main(capsys, "inspect", f"{url}-nothing")
    assert_one_line_error(result, f"{url}-nothing", "no objects")


def test_access_denied_names_the_credential_source_never_the_secret(
    fresh: tuple[str, Path], proxy: Any
) -> None:
    url, _ = fresh
    proxy.inject("denied", times=100)
    result = _cli("inspect", url)
    assert_one_line_error(result, "access denied", "credentials from env", "'models'", "127.0.0.1")
    for secret in (CANARY, ACCESS_KEY):
        assert secret not in result.stderr + result.stdout


def test_an_unreachable_endpoint_exits_2_within_the_timeout(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    result = _cli("inspect", "s3://models/index", AWS_ENDPOINT_URL=closed)
    assert_one_line_error(result, "cannot reach the S3 endpoint", closed)
    assert time.monotonic() - start < 60


def test_a_blackholed_endpoint_exits_2_within_the_load_timeout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port whose accept queue is full drops new connections' SYNs (as a firewall
    does): each attempt waits out its connect time-out; the load gives up at --timeout,
    not after every attempt and back-off (about 30 s). In this process, so the time is
    the load's, not the CLI's start-up."""
    import socket

    import boto3  # noqa: F401 (imported before the clock starts, as rayload.api is)

    import rayload.api  # noqa: F401
    from rayload.loading.storage import forget_s3_clients

    timeout = 8
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        fillers = []
        for _ in range(4):  # fill the queue; never accepted
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        forget_s3_clients()
        try:
            start = time.monotonic()
            result = _main(capsys, "load", "s3://models/index", "--tp", "2", "--timeout", "8")
            elapsed = time.monotonic() - start
        finally:
            forget_s3_clients()
            for filler in fillers:
                filler.close()
    assert_one_line_error(result, f"within the load's timeout ({timeout} s", "127.0.0.1")
    assert elapsed <= timeout, elapsed


def test_a_body_that_stops_after_its_headers_is_an_error_within_the_rank_deadline(
    fresh: tuple[str, Path], proxy: Any
) -> None:
    """The server answers a rank's data GETs with headers, then nothing (an endpoint gone
    silent after the driver read the headers): within the storage deadline a rank has
    from its load request, each read gives up and the rank fails naming the endpoint,
    instead of waiting out its read time-out (30 s) per attempt past the load's wait."""
    from rayload.loading.storage import storage_deadline

    url, first = fresh
    proxy.inject("blackhole", suffix=".safetensors", times=1000, min_start=data_start(first))
    timeout = 6
    start = time.monotonic()
    with storage_deadline(4.5, of=timeout), pytest.raises(StorageError) as info:
        load_rank(url, 0, 2)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert f"within the load's timeout ({timeout} s" in message and ENDPOINT in message
    assert ".safetensors" in message
    assert elapsed < 4.5, elapsed
    assert any(r.status == 206 and r.body_bytes == 0 for r in proxy.requests()), "no blackhole"


def test_deadlines_of_loads_that_overlap_in_threads_never_outlive_their_loads() -> None:
    """Two loads in threads of one process, the first leaving first (the driver of a
    pipeline, a Serve replica): each takes only its own deadline away, so none is left
    to refuse every later request once it has passed."""
    from rayload.loading.storage import storage_deadline
    from rayload.loading.storage.base import current_deadline

    first, second = storage_deadline(300), storage_deadline(60, of=600)
    first.__enter__()
    second.__enter__()
    assert current_deadline() is not None and current_deadline()[1] == 600
    first.__exit__(None, None, None)
    assert current_deadline() is not None and current_deadline()[1] == 600
    second.__exit__(None, None, None)
    assert current_deadline() is None


def test_the_peer_key_of_an_s3_checkpoint_costs_no_request_and_follows_its_content(
    fresh: tuple[str, Path], s3: S3Server, tiny_llama: Path, proxy: Any
) -> None:
    """The key under which replicas share shards comes from the objects' sizes and ETags
    as the checkpoint was opened: no request; the same for a copy uploaded alike; another
    once one object is rewritten."""
    url, first = fresh
    checkpoint = open_checkpoint(url)
    proxy.clear()
    key = checkpoint_identity(checkpoint)
    assert proxy.requests() == []
    copy = s3.upload(tiny_llama, "models", "faults/identity-copy")
    assert checkpoint_identity(open_checkpoint(copy)) == key
    rewrite(s3.client, *f"{url}/{first.name}".removeprefix("s3://").split("/", 1))
    assert checkpoint_identity(open_checkpoint(url)) != key
