"""A rank that raises, dies or hangs ends the load promptly with an error naming the rank,
its node and the cause; the other ranks are stopped, nothing is leaked, and the trace is
still written with the failing rank marked ERROR."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

import rayload
from rayload.errors import (
    ConfigError,
    MethodUnavailableError,
    RankFailedError,
    RankTimeoutError,
)

pytestmark = pytest.mark.usefixtures("ray_cluster")

HANG_TIMEOUT_S = 15
"""The hung-rank test's whole wait: a few times what a TP=2 load of the tiny Llama takes
here (rank 0 must finish before it), since the test waits all of it out."""


def _node() -> str:
    return ray.get_runtime_context().get_node_id()


def _kill_and_wait(actor: Any, timeout_s: float = 30.0) -> None:
    """``ray.kill`` the actor and return once it is dead: the kill is asynchronous, and a
    call sent right after it may still be served by the living actor."""
    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor {actor} still answers {timeout_s:g} s after ray.kill")


def _rank_load(spans: list[Any], rank: int) -> Any:
    (span,) = [s for s in spans if s.name == "rank.load" and s.rank == rank]
    return span


def test_rank_that_raises_fails_load_naming_rank_node_and_cause(
    tiny_llama: Path,
    tmp_path: Path,
    set_test_hooks: Callable[..., None],
    trace_reader: Callable[[Path], list[Any]],
    no_leaks: object,
) -> None:
    set_test_hooks(fault={"rank": 1, "phase": "rank.read", "action": "raise"})
    with pytest.raises(RankFailedError) as caught:
        rayload.load(tiny_llama, 2, method="scratch", device="cpu", trace_dir=tmp_path)
    error = caught.value
    assert (error.rank, error.node_id) == (1, _node())
    assert "RuntimeError: injected fault in rank.read" in error.cause
    assert f"rank 1 on node {_node()} failed" in str(error)
    spans = trace_reader(tmp_path)
    assert _rank_load(spans, 1).error
    (read,) = [s for s in spans if s.name == "rank.read" and s.rank == 1]
    assert read.error, "the failing phase itself is marked ERROR"
    assert [s.error for s in spans if s.name == "rayload.load"] == [True]


def test_rank_whose_process_exits_fails_load_with_stand_in_span(
    tiny_llama: Path,
    tmp_path: Path,
    set_test_hooks: Callable[..., None],
    trace_reader: Callable[[Path], list[Any]],
    no_leaks: object,
) -> None:
    set_test_hooks(fault={"rank": 0, "phase": "rank.plan", "action": "exit"})
    with pytest.raises(RankFailedError, match=r"rank 0 on node .* actor died") as caught:
        rayload.load(tiny_llama, 2, method="scratch", device="cpu", trace_dir=tmp_path)
    assert (caught.value.rank, caught.value.node_id) == (0, _node())
    stand_in = _rank_load(trace_reader(tmp_path), 0)
    assert stand_in.error and stand_in.attributes["rayload.spans_lost"] is True
    assert stand_in.attributes["rayload.node_id"] == _node()


def test_rank_killed_with_ray_kill_fails_load(
    tiny_llama: Path, set_test_hooks: Callable[..., None], no_leaks: object
) -> None:
    set_test_hooks(fault={"rank": 1, "phase": "rank.read", "action": "ray_kill", "seconds": 60})
    with pytest.raises(RankFailedError, match=r"rank 1 on node .*killed by `ray\.kill`"):
        rayload.load(tiny_llama, 2, method="scratch", device="cpu", timeout=60)


def test_rank_that_hangs_times_out_naming_rank_and_stops_the_others(
    tiny_llama: Path,
    tmp_path: Path,
    set_test_hooks: Callable[..., None],
    trace_reader: Callable[[Path], list[Any]],
    no_leaks: object,
) -> None:
    set_test_hooks(fault={"rank": 1, "phase": "rank.read", "action": "hang", "seconds": 600})
    with pytest.raises(RankTimeoutError) as caught:
        rayload.load(
            tiny_llama,
            2,
            method="scratch",
            device="cpu",
            timeout=HANG_TIMEOUT_S,
            trace_dir=tmp_path,
        )
    error = caught.value
    assert (error.rank, error.node_id, error.timeout_s) == (1, _node(), HANG_TIMEOUT_S)
    assert "rank 1 on node" in str(error) and f"timed out after {HANG_TIMEOUT_S} s" in str(error)
    spans = trace_reader(tmp_path)
    assert _rank_load(spans, 1).error
    assert not _rank_load(spans, 0).error, "rank 0 finished before the deadline"


def test_actor_that_fails_to_start_fails_load_and_traces_every_rank(
    tiny_llama: Path,
    tmp_path: Path,
    set_test_hooks: Callable[..., None],
    trace_reader: Callable[[Path], list[Any]],
    no_leaks: object,
) -> None:
    set_test_hooks(fault={"rank": 1, "phase": "actor.init", "action": "raise"})
    with pytest.raises(RankFailedError, match=r"rank 1 on node .* __init__ raised RuntimeError"):
        rayload.load(tiny_llama, 2, method="scratch", device="cpu", trace_dir=tmp_path)
    spans = trace_reader(tmp_path)
    assert all(_rank_load(spans, rank).error for rank in (0, 1))


def test_strict_method_unavailable_on_rank_is_input_error_naming_rank(
    tiny_llama: Path, no_leaks: object
) -> None:
    with pytest.raises(MethodUnavailableError, match=r"rank \d on node ") as caught:
        rayload.load(tiny_llama, 2, method="fastsafetensors_gdr", device="cpu", strict=True)
    assert caught.value.rank in (0, 1)
    assert caught.value.node_id == _node()
    assert f"rank {caught.value.rank} on node {caught.value.node_id}" in str(caught.value)


def test_shard_from_rank_killed_after_load_raises_rank_failed(
    tiny_llama: Path, no_leaks: object
) -> None:
    with rayload.load(tiny_llama, 2, method="dummy", device="cpu") as result:
        _kill_and_wait(result.actors[1])
        with pytest.raises(RankFailedError, match=r"rank 1 on node .* is gone") as caught:
            result.shard(1, "model.norm.weight")
        assert caught.value.node_id == _node()
        assert result.shard(0, "model.norm.weight").numel() > 0


def test_unsatisfiable_placement_names_resources_and_leaves_no_group(
    tiny_llama: Path,
    tmp_path: Path,
    trace_reader: Callable[[Path], list[Any]],
    no_leaks: object,
) -> None:
    # 8 GPU bundles on a cluster with 4 (fake) GPUs.
    with pytest.raises(ConfigError, match=r"cannot place 8 rank bundle.*GPU: 8.*GPU: 4"):
        rayload.load(tiny_llama, 8, method="dummy", device="auto", trace_dir=tmp_path)
    (placement,) = [s for s in trace_reader(tmp_path) if s.name == "rayload.placement"]
    assert placement.error
