"""rayload.cluster without Ray: where an address comes from, and the one-line error when
nothing answers there."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rayload.cluster import ClusterAddress, address_file, check_reachable, find_address
from rayload.errors import ConfigError


@pytest.fixture
def ray_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    return tmp_path


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_find_address_follows_argument_then_env_then_recorded_file(
    ray_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert find_address(None) == ClusterAddress(None, "none")
    recorded = ray_tmp / "ray" / "ray_current_cluster"
    recorded.parent.mkdir()
    recorded.write_text("10.0.0.1:6379\n")
    assert address_file() == str(recorded)
    assert find_address(None) == ClusterAddress("10.0.0.1:6379", "file", file=str(recorded))
    assert find_address("auto").source == "file"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert find_address(None) == ClusterAddress("10.0.0.2:6379", "RAY_ADDRESS")
    assert find_address("10.0.0.3:6379") == ClusterAddress("10.0.0.3:6379", "--address")
    assert find_address("local") == ClusterAddress("local", "--address")


@pytest.mark.parametrize(
    ("source", "named", "remedy"),
    [
        ("--address", "from --address / address=", "pass the right --address"),
        ("RAY_ADDRESS", "from RAY_ADDRESS", "fix or unset RAY_ADDRESS"),
        ("file", "recorded by `ray start` in /x/ray_current_cluster", "remove the stale file"),
    ],
)
def test_check_reachable_unanswered_address_names_it_its_source_and_what_to_do(
    source: str, named: str, remedy: str
) -> None:
    address = f"127.0.0.1:{_dead_port()}"
    found = ClusterAddress(address, source, file="/x/ray_current_cluster")
    with pytest.raises(ConfigError) as caught:
        check_reachable(found, timeout_s=2)
    message = str(caught.value)
    assert message.startswith(f"cannot reach a Ray cluster at {address} ({named}): ")
    assert remedy in message and "--address local" in message and "\n" not in message


@pytest.mark.parametrize("address", [None, "local", "auto"])
def test_check_reachable_passes_addresses_without_a_port(address: str | None) -> None:
    check_reachable(ClusterAddress(address, "--address"), timeout_s=0.1)
