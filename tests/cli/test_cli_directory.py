"""``rayload directory`` finds its cluster as ``load`` does, but never starts one: nothing
to look in, ``--address local`` or an address nobody answers is exit code 2 with one line
on stderr, in seconds. (The directory on a real cluster: tests/ray_cluster/test_cli_load.py.)"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import ray

from rayload.cli import main


@pytest.fixture
def no_recorded_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No RAY_ADDRESS and no `ray start` record (another cluster on this machine may have
    written /tmp/ray/ray_current_cluster), and no Ray in this process."""
    if ray.is_initialized():
        pytest.skip("a Ray is initialized in this process: the command would use it")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))


def _free_port() -> int:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.usefixtures("no_recorded_cluster")
def test_directory_without_a_cluster_exits_2_saying_where_to_look(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["directory"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "rayload: error: no Ray cluster to look in (no --address, RAY_ADDRESS or `ray start` "
        "cluster on this machine): pass --address host:port of the cluster the loads ran on\n"
    )
    assert not ray.is_initialized()


@pytest.mark.usefixtures("no_recorded_cluster")
def test_directory_address_local_exits_2_since_a_new_ray_has_no_directory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["directory", "--address", "local", "--json"]) == 2
    captured = capsys.readouterr()
    assert "no Ray cluster to look in" in captured.err and captured.err.count("\n") == 1
    assert '"exit_code": 2' in captured.out  # --json: stdout is still one JSON object
    assert not ray.is_initialized()


@pytest.mark.usefixtures("no_recorded_cluster")
def test_directory_unreachable_address_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = _free_port()
    assert main(["directory", "--address", f"127.0.0.1:{port}"]) == 2
    assert capsys.readouterr().err == (
        f"rayload: error: cannot reach a Ray cluster at 127.0.0.1:{port} (from --address / "
        "address=): Connection refused; pass the --address of the running cluster the loads "
        "ran on\n"
    )
    assert not ray.is_initialized()


@pytest.mark.usefixtures("no_recorded_cluster")
def test_directory_stale_ray_start_record_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "ray" / "ray_current_cluster"
    record.parent.mkdir()
    record.write_text(f"127.0.0.1:{_free_port()}\n")
    assert main(["directory", "--stop"]) == 2
    err = capsys.readouterr().err
    assert f"recorded by `ray start` in {record}" in err and err.count("\n") == 1
