"""Loading from a real S3-protocol server (moto on 127.0.0.1, through the counting proxy):
shards bit-identical to the local load in every layout, the driver's metadata reads, the
bytes the server serves, the storage in the report and the trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rayload.cli import main
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.rank import load_rank
from support.s3 import data_start

LAYOUTS = ("single", "index", "converted")


def _tp(layout: str) -> tuple[int, ...]:
    return (2,) if layout == "converted" else (1, 2, 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_s3_shards_equal_the_local_load_bit_for_bit(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any, layout: str
) -> None:
    local, url = s3_checkpoints[layout]
    for tp in _tp(layout):
        for rank in range(tp):
            want, local_report = load_rank(local, rank, tp, "auto")
            got, report = load_rank(url, rank, tp, "auto")
            assert got.keys() == want.keys()
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
            assert report.method.effective == local_report.method.effective
            assert (report.storage, report.storage_bucket) == ("s3", "models")
            assert report.storage_endpoint == "127.0.0.1"
            assert report.requests > 0 and report.retries == 0
            assert local_report.storage == "file" and local_report.requests == 0


def _metadata_bytes(local: Path) -> int:
    """Bytes of config.json, the index or manifest, and each safetensors header (its
    8-byte length and JSON): all a driver needs."""
    total = 0
    for path in local.iterdir():
        if path.name in ("config.json", "model.safetensors.index.json", "rayload-manifest.json"):
            total += path.stat().st_size
        elif path.suffix == ".safetensors":
            total += data_start(path)
    return total


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_and_plan_fetch_only_headers_and_config(
    s3_checkpoints: dict[str, tuple[Path, str]],
    proxy: Any,
    layout: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    local, url = s3_checkpoints[layout]
    for command in (["inspect", url, "--json"], ["plan", url, "--tp", "2", "--json"]):
        proxy.clear()
        assert main(command) == 0
        json.loads(capsys.readouterr().out)
        gets = [r for r in proxy.requests(f"models/{layout}/") if r.method == "GET"]
        assert proxy.served_bytes(f"models/{layout}/") == _metadata_bytes(local), gets
        # 8 bytes then the header, per file
        headers = [r for r in gets if r.key.endswith(".safetensors")]
        assert len(headers) == 2 * sum(1 for p in local.iterdir() if p.suffix == ".safetensors")


def _data_gets_only(requests: list[Any], local: Path, *, whole_files: bool = False) -> None:
    """Every request a rank given the driver's checkpoint sent: a ranged GET of tensor
    bytes (no listing, HEAD, config, index or manifest; no header read, except inside
    the ``whole_files`` of the converted layout, whose CRC-32 covers header and data)."""
    starts = {p.name: 0 if whole_files else data_start(p) for p in local.glob("*.safetensors")}
    assert requests
    for r in requests:
        name = r.key.rpartition("/")[2]
        assert r.method == "GET" and name in starts and r.range is not None, r
        assert int(r.range.removeprefix("bytes=").partition("-")[0]) >= starts[name], r


def test_one_tp_group_is_served_the_bytes_its_ranks_report(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any
) -> None:
    """What ``rayload.load``'s ranks do: given the driver's opened checkpoint, they send
    only their data GETs. A rank on its own (a vLLM worker) reads the headers itself."""
    local, url = s3_checkpoints["index"]
    checkpoint = open_checkpoint(url)  # the driver
    proxy.clear()
    reports = [load_rank(url, rank, 2, "auto", checkpoint=checkpoint)[1] for rank in range(2)]
    served = proxy.served_bytes("models/index/")
    _data_gets_only(proxy.requests("models/index/"), local)
    assert served == sum(r.bytes_read for r in reports)
    ratio = served / checkpoint.tensor_bytes
    print(f"one TP=2 group served {ratio:.3f}x the checkpoint's tensor bytes")
    assert 1.0 <= ratio < 1.5
    proxy.clear()
    alone = load_rank(url, 0, 2, "auto")[1]
    assert proxy.served_bytes("models/index/") == _metadata_bytes(local) + alone.bytes_read
    assert alone.bytes_read == reports[0].bytes_read


def test_one_tp_group_of_the_converted_layout_is_served_the_checkpoint_once(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any
) -> None:
    """The converted layout holds each rank's shards contiguously: a TP group's ranks
    fetch exactly their bytes, no other rank's rows (the HF layout's split-1 rows are
    fetched as runs, gaps included: see the test above)."""
    original, _ = s3_checkpoints["index"]
    local, url = s3_checkpoints["converted"]
    checkpoint = open_checkpoint(url)
    proxy.clear()
    reports = [load_rank(url, rank, 2, "auto", checkpoint=checkpoint)[1] for rank in range(2)]
    assert all(r.method.effective.value == "converted" for r in reports)
    served = proxy.served_bytes("models/converted/")
    _data_gets_only(proxy.requests("models/converted/"), local, whole_files=True)
    assert served == sum(r.bytes_read for r in reports)
    ratio = served / open_checkpoint(original).tensor_bytes
    print(f"one TP=2 group of the converted layout served {ratio:.4f}x the checkpoint")
    assert 1.0 <= ratio <= 1.01


def test_fastsafetensors_on_s3_falls_back_with_a_reason_or_fails_under_strict(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any
) -> None:
    from rayload.errors import MethodUnavailableError

    _, url = s3_checkpoints["index"]
    _, report = load_rank(url, 0, 2, "fastsafetensors")
    assert report.method.effective.value == "scratch"
    assert "object storage" in (report.method.fallback_reason or "")
    with pytest.raises(MethodUnavailableError, match="object storage"):
        load_rank(url, 0, 2, "fastsafetensors", strict=True)


def test_dummy_on_s3_reads_no_tensor_bytes(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any
) -> None:
    local, url = s3_checkpoints["index"]
    tensors, report = load_rank(url, 0, 2, "dummy")
    assert tensors and report.bytes_read == 0
    assert proxy.served_bytes("models/index/") == _metadata_bytes(local)


def test_s3_reads_are_traced_with_the_storage(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any
) -> None:
    _, url = s3_checkpoints["index"]
    _, report = load_rank(url, 1, 2, "scratch")
    [read] = [p for p in report.phases if p.name == "rank.read"]
    assert read.attributes["rayload.storage"] == "s3"
    assert read.attributes["rayload.storage.endpoint"] == "127.0.0.1"
    assert read.attributes["rayload.storage.bucket"] == "models"
    as_json = report.to_dict()
    assert as_json["storage"] == "s3" and as_json["requests"] == report.requests


def test_convert_from_s3_writes_the_local_conversion_and_its_side_files(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any, tmp_path: Path
) -> None:
    """``convert`` with an ``s3://`` source: the same rank files as from the local copy
    (byte for byte) and the side files (config.json) copied from the bucket."""
    from rayload.loading.convert import convert_checkpoint

    local, url = s3_checkpoints["index"]
    from_s3 = convert_checkpoint(url, tmp_path / "from-s3", 2)
    from_disk = convert_checkpoint(local, tmp_path / "from-disk", 2)
    names = sorted(p.name for p in from_disk.iterdir())
    assert "config.json" in names
    assert sorted(p.name for p in from_s3.iterdir()) == names
    for name in names:
        assert (from_s3 / name).read_bytes() == (from_disk / name).read_bytes(), name
    tensors, report = load_rank(from_s3, 1, 2, "auto")
    assert report.method.effective.value == "converted" and tensors
