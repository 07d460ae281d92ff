"""The process group's pure parts (argument check, backend, rendezvous host) and a real
one-rank gloo group joined and left in this process, without Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rayload.actors.process_group import (
    LOOPBACK,
    check_process_group,
    init_method,
    rendezvous_host,
    resolve_backend,
)
from rayload.errors import ConfigError


@pytest.mark.parametrize("value", ["auto", "gloo", "nccl", None])
def test_check_process_group_accepts_the_choices(value: str | None) -> None:
    check_process_group(value, "auto")


@pytest.mark.parametrize("value", ["mpi", "", "GLOO", 1])
def test_check_process_group_rejects_anything_else_naming_the_choices(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        check_process_group(value, "auto")
    assert str(info.value) == (
        f"process_group must be one of auto, gloo, nccl or None, got {value!r}"
    )


def test_check_process_group_nccl_on_cpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="process_group='nccl' needs CUDA devices"):
        check_process_group("nccl", "cpu")


@pytest.mark.parametrize(
    ("requested", "devices", "backend"),
    [
        ("auto", {0: "cuda:0", 1: "cuda:0"}, "nccl"),
        ("auto", {0: "cpu", 1: "cpu"}, "gloo"),
        ("auto", {0: "cuda:0", 1: "cpu"}, "gloo"),
        ("gloo", {0: "cuda:0", 1: "cuda:0"}, "gloo"),
        ("nccl", {0: "cuda:0", 1: "cuda:0"}, "nccl"),
    ],
)
def test_resolve_backend_is_nccl_only_when_every_rank_is_on_cuda(
    requested: str, devices: dict[int, str], backend: str
) -> None:
    assert resolve_backend(requested, devices) == backend


def test_resolve_backend_nccl_with_a_cpu_rank_names_it() -> None:
    with pytest.raises(ConfigError, match=r"^rank 1: process_group='nccl' needs a CUDA device"):
        resolve_backend("nccl", {0: "cuda:0", 1: "cpu", 2: "cpu"})


def test_rendezvous_host_is_loopback_on_one_node_else_rank_0s_ip() -> None:
    assert rendezvous_host({0: "10.0.0.5"}, {0: "n1", 1: "n1"}) == LOOPBACK
    assert rendezvous_host({0: "10.0.0.5"}, {0: "n1", 1: "n2"}) == "10.0.0.5"
    assert rendezvous_host({0: "10.0.0.5"}, {0: "n1", 1: None}) == "10.0.0.5"
    assert init_method("10.0.0.5", 29500) == "tcp://10.0.0.5:29500"
    assert init_method("fe80::1", 29500) == "tcp://[fe80::1]:29500"


_ONE_RANK = """
import torch, torch.distributed as dist
from rayload.actors.process_group import (
    ProcessGroupSpec, free_port, init_method, join_process_group, leave_process_group)
from rayload.loading.report import PhaseTimer
timer = PhaseTimer()
spec = ProcessGroupSpec("gloo", init_method("127.0.0.1", free_port()), 1, 30.0)
group = join_process_group(spec, rank=0, device="cpu", timer=timer)
value = torch.tensor([5.0]); dist.all_reduce(value, group=group)
(record,) = timer.records
print(record.name, record.attributes["backend"], record.attributes["world_size"], value.item())
print(leave_process_group(5.0), dist.is_initialized(), leave_process_group(5.0))
"""


def test_join_and_leave_a_one_rank_gloo_group_in_a_plain_process() -> None:
    # A subprocess: a default group is per process and must not leak into other tests.
    done = subprocess.run(
        [sys.executable, "-c", _ONE_RANK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["rank.process_group gloo 1 5.0", "True False False"]
