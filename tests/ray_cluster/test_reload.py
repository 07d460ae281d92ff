"""``LoadResult.reload``: new weights into the same actors' resident tensors, in place."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.util.state import list_actors

import rayload
from rayload.errors import CheckpointError
from rayload.loading import load_rank, write_checkpoint
from rayload.models import build_model
from rayload.tracing import schema

pytestmark = pytest.mark.usefixtures("ray_cluster")

# Ray's workers cannot import tests/: send this module's functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _storage(state: Any) -> dict[str, int]:
    """Every resident tensor's and model parameter's data pointer on one rank."""
    pointers = {name: t.data_ptr() for name, t in state.tensors.items()}
    pointers.update({f"param:{n}": p.data_ptr() for n, p in state.model.named_parameters()})
    return pointers


def _alive_actors(state_address: str) -> set[str]:
    alive = list_actors(
        address=state_address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
    )
    return {a.actor_id for a in alive}


def test_reload_fills_the_same_tensors_and_model_in_the_same_actors(
    tiny_llama: Path,
    tmp_path: Path,
    ray_cluster: Any,
    trace_reader: Callable[[Path], list[Any]],
    no_leaks: object,
) -> None:
    other = write_checkpoint(tmp_path / "other", seed=99)
    trace_dir = tmp_path / "traces"
    with rayload.load(
        tiny_llama, 2, method="scratch", device="cpu", model=build_model, trace_dir=trace_dir
    ) as result:
        before = result.apply(_storage)
        actors = _alive_actors(ray_cluster.state_address)
        reloaded = result.reload(other)
        assert result.apply(_storage) == before, "no tensor or parameter was reallocated"
        assert _alive_actors(ray_cluster.state_address) == actors, "no new actor"
        for rank in range(2):
            fresh, _ = load_rank(other, rank, 2, "scratch", "cpu")
            for name, tensor in fresh.items():
                assert torch.equal(result.shard(rank, name), tensor), (rank, name)
        embed = result.apply(
            lambda state: state.model.get_parameter("model.embed_tokens.weight").clone()
        )
        assert torch.equal(embed[1], load_rank(other, 1, 2)[0]["model.embed_tokens.weight"])
        assert result.ranks == reloaded.ranks
        assert reloaded.startup_metrics["aggregate"]["bytes_read"]["max"] > 0
    spans = trace_reader(trace_dir / "reload-1")
    (root,) = [s for s in spans if s.name == schema.RELOAD_ROOT_SPAN]
    assert f"{reloaded.trace_id}" and not any(s.name == schema.ROOT_SPAN for s in spans)
    assert sorted(s.rank for s in spans if s.name == schema.RANK_SPAN) == [0, 1]
    assert all(root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns for s in spans)
    assert any(s.name == schema.ROOT_SPAN for s in trace_reader(trace_dir)), "load's trace kept"


def test_reload_of_other_shapes_is_one_error_and_writes_nothing(
    tiny_llama: Path, tmp_path: Path, no_leaks: object
) -> None:
    smaller = write_checkpoint(tmp_path / "smaller", size_gb=0.001, seed=5)
    with rayload.load(tiny_llama, 2, method="scratch", device="cpu") as result:
        names = [s.name for s in result.plan.ranks[0].shards]
        before = {name: result.shard(0, name) for name in names}
        with pytest.raises(CheckpointError) as caught:
            result.reload(smaller)
        assert caught.value.tensor and caught.value.tensor in str(caught.value)
        for name in names:
            assert torch.equal(result.shard(0, name), before[name]), name
        # The group is still usable: reloading the loaded checkpoint works.
        result.reload()
