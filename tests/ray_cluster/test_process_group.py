"""``rayload.load(process_group=...)`` on the session's real Ray: the ranks of a load form
one working ``torch.distributed`` group (a real all-reduce), traced as
``rank.process_group``; two loads open at once have two groups; ``close()`` destroys the
group and leaves nothing behind; bad arguments and a rank failing before the rendezvous
end the load promptly with an error naming what is wrong."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import torch.distributed as dist

import rayload
from rayload.actors.messages import RankState
from rayload.errors import ConfigError, RankFailedError

pytestmark = pytest.mark.usefixtures("ray_cluster")

# Ray's workers cannot import test modules: send this module's functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def all_reduce(state: RankState, scale: int) -> dict[str, Any]:
    """Sum ``scale * (rank + 1)`` over the group."""
    value = torch.tensor([float(scale * (state.rank + 1))])
    dist.all_reduce(value, group=state.process_group)
    return {
        "sum": value.item(),
        "world": dist.get_world_size(),
        "rank": dist.get_rank(),
        "backend": dist.get_backend(),
        "model": state.model,
    }


def test_gloo_group_all_reduce_gives_the_sum_on_every_rank(
    tiny_llama: Path, no_leaks: object
) -> None:
    with rayload.load(tiny_llama, 2, device="cpu", process_group="gloo") as result:
        assert result.process_group == "gloo"
        answers = result.apply(all_reduce, 1)
    assert [a["sum"] for a in answers] == [3.0, 3.0]
    assert [(a["rank"], a["world"], a["backend"]) for a in answers] == [
        (0, 2, "gloo"),
        (1, 2, "gloo"),
    ]
    assert [a["model"] for a in answers] == [None, None], "no model= factory, no model"


def test_auto_group_on_cpu_devices_is_gloo_and_traced_inside_each_rank_load(
    tiny_llama: Path,
    tmp_path: Path,
    trace_reader: Callable[[Path], list[Any]],
    no_leaks: object,
) -> None:
    # device="auto" on the fake-GPU cluster: each rank gets a GPU bundle, torch sees no CUDA.
    with rayload.load(tiny_llama, 2, device="auto", trace_dir=tmp_path) as result:
        assert result.process_group == "gloo"
        assert [a["sum"] for a in result.apply(all_reduce, 2)] == [6.0, 6.0]
        metrics = result.startup_metrics
    spans = trace_reader(tmp_path)
    groups = {s.rank: s for s in spans if s.name == "rank.process_group"}
    loads = {s.rank: s for s in spans if s.name == "rank.load"}
    resolves = {s.rank: s for s in spans if s.name == "rank.resolve"}
    assert set(groups) == {0, 1}
    ports = set()
    for rank, span in groups.items():
        assert span.attributes["rayload.backend"] == "gloo"
        assert span.attributes["rayload.world_size"] == 2
        init = span.attributes["rayload.init_method"]
        assert init.startswith("tcp://127.0.0.1:"), init
        ports.add(init)
        assert loads[rank].start_ns <= span.start_ns <= span.end_ns <= resolves[rank].start_ns
    assert len(ports) == 1, "one rendezvous for the group"
    # The metrics are the load's: the total starts with rank.resolve, not the group.
    for rank, figures in enumerate(metrics["ranks"]):
        loaded = (loads[rank].end_ns - resolves[rank].start_ns) / 1e9
        assert figures["total_model_loading_seconds"] == pytest.approx(loaded, abs=2e-3)


def test_process_group_none_makes_no_group(
    tiny_llama: Path, tmp_path: Path, trace_reader: Callable[[Path], list[Any]], no_leaks: object
) -> None:
    with rayload.load(
        tiny_llama, 2, device="cpu", process_group=None, trace_dir=tmp_path
    ) as result:
        assert result.process_group is None
        assert result.apply(lambda state: (state.process_group, dist.is_initialized())) == [
            (None, False),
            (None, False),
        ]
    assert not [s for s in trace_reader(tmp_path) if s.name == "rank.process_group"]


def test_two_loads_open_at_once_each_have_their_own_working_group(
    tiny_llama: Path, no_leaks: object
) -> None:
    with (
        rayload.load(tiny_llama, 2, device="cpu", process_group="gloo") as first,
        rayload.load(tiny_llama, 2, device="cpu", process_group="gloo") as second,
    ):
        refs_first = [a.apply.remote(all_reduce, 1) for a in first.actors]
        refs_second = [a.apply.remote(all_reduce, 10) for a in second.actors]
        answers = ray.get(refs_first + refs_second)
    # Crossed groups would mix the loads' ranks: sums other than 3 and 30, or a hang.
    assert [a["sum"] for a in answers] == [3.0, 3.0, 30.0, 30.0]
    assert all(a["world"] == 2 for a in answers)


def test_close_destroys_the_group_and_leaves_no_actor_or_placement_group(
    tiny_llama: Path, no_leaks: object
) -> None:
    result = rayload.load(tiny_llama, 2, device="cpu", process_group="gloo")
    actors = list(result.actors)
    # What close() asks first, asked here so its effect can be seen before the kill.
    assert ray.get([a.shutdown.remote(5.0) for a in actors]) == [True, True]
    assert ray.get([a.apply.remote(lambda s: dist.is_initialized()) for a in actors]) == [
        False,
        False,
    ]
    started = time.monotonic()
    result.close()
    assert time.monotonic() - started < 10
    result.close()  # idempotent


@pytest.mark.parametrize(
    ("value", "device", "message"),
    [
        ("mpi", "cpu", "process_group must be one of auto, gloo, nccl or None, got 'mpi'"),
        (True, "cpu", "process_group must be one of auto, gloo, nccl or None, got True"),
        ("nccl", "cpu", "process_group='nccl' needs CUDA devices but device='cpu'"),
    ],
)
def test_bad_process_group_is_a_config_error_before_any_actor(
    value: Any, device: str, message: str, tiny_llama: Path, no_leaks: object
) -> None:
    with pytest.raises(ConfigError) as info:
        rayload.load(tiny_llama, 2, device=device, process_group=value)
    assert str(info.value) == message or str(info.value).startswith(message)
    assert info.value.exit_code == 2


def test_nccl_with_ranks_on_the_cpu_names_the_rank_and_releases_everything(
    tiny_llama: Path, no_leaks: object
) -> None:
    # device="auto" resolves to cpu in every rank (torch has no CUDA here).
    with pytest.raises(ConfigError, match=r"rank 0: process_group='nccl' needs a CUDA device"):
        rayload.load(tiny_llama, 2, device="auto", process_group="nccl", timeout=60)


def test_rank_failing_before_the_rendezvous_fails_the_load_promptly_naming_it(
    tiny_llama: Path,
    tmp_path: Path,
    set_test_hooks: Callable[..., None],
    trace_reader: Callable[[Path], list[Any]],
    no_leaks: object,
) -> None:
    # Rank 1 raises as it starts joining: rank 0 is left waiting in the rendezvous.
    set_test_hooks(fault={"rank": 1, "phase": "rank.process_group", "action": "raise"})
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        rayload.load(
            tiny_llama, 2, device="cpu", process_group="gloo", timeout=120, trace_dir=tmp_path
        )
    assert time.monotonic() - started < 30, "not the 120 s deadline nor the group's timeout"
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 on node ")
    failed = [s for s in trace_reader(tmp_path) if s.name == "rank.process_group" and s.error]
    assert [s.rank for s in failed] == [1]
