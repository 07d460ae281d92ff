"""``rayload.load`` on the session's real Ray: every method at TP 1, 2 and 4 gives shards
bit-identical to the safetensors reference, placement is GPU-shaped on (fake) GPUs, and
the result releases everything it holds."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import rayload
from rayload.actors.messages import RankState
from rayload.loading import convert_checkpoint, plan_shards
from rayload.loading.dtypes import torch_dtype

METHODS_READING_DATA = ("auto", "scratch", "converted", "fastsafetensors")

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def converted(mixed_dtype_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``tp -> path`` of ``mixed_dtype_checkpoint`` converted by ``convert_checkpoint``."""
    made: dict[int, Path] = {}

    def get(tp: int) -> Path:
        if tp not in made:
            out = tmp_path_factory.mktemp(f"converted-tp{tp}") / "ckpt"
            made[tp] = convert_checkpoint(mixed_dtype_checkpoint, out, tp)
        return made[tp]

    return get


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("method", METHODS_READING_DATA)
def test_load_shards_match_safetensors_reference_for_every_method(
    method: str,
    tp: int,
    mixed_dtype_checkpoint: Path,
    converted: Callable[[int], Path],
    reference_shard: Callable[..., torch.Tensor],
    no_leaks: object,
) -> None:
    path = converted(tp) if method == "converted" else mixed_dtype_checkpoint
    expected_plan = plan_shards(mixed_dtype_checkpoint, tp)
    with rayload.load(path, tp_size=tp, method=method, device="cpu", timeout=120) as result:
        assert [r.rank for r in result.ranks] == list(range(tp))
        assert {r.method.effective.value for r in result.ranks} == {
            "scratch" if method == "auto" else method
        }
        for rank in range(tp):
            for name, split in expected_plan.splits.items():
                assert result.plan.split_dim(name) == split
                got = result.shard(rank, name)
                want = reference_shard(mixed_dtype_checkpoint, rank, tp, name, split)
                assert got.dtype == want.dtype, name
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (rank, name)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_load_dummy_gives_planned_shapes_and_dtypes_without_reading(
    tp: int, mixed_dtype_checkpoint: Path, no_leaks: object
) -> None:
    plan = plan_shards(mixed_dtype_checkpoint, tp)
    with rayload.load(mixed_dtype_checkpoint, tp, method="dummy", device="cpu") as result:
        assert all(r.bytes_read == 0 for r in result.ranks)
        for rank_plan in plan.ranks:
            for shard in rank_plan.shards:
                got = result.shard(rank_plan.rank, shard.name)
                assert tuple(got.shape) == shard.shape
                assert got.dtype == torch_dtype(shard.dtype)


def test_load_on_gpu_cluster_gives_each_rank_its_own_gpu_and_local_device(
    tiny_llama: Path, no_leaks: object
) -> None:
    # Defined here, not at module level: a nested function travels to the actors by value,
    # whereas a test module's top-level function would have to be importable there.
    def gpu_view(state: RankState) -> dict[str, Any]:
        return {
            "rank": state.rank,
            "device": state.device,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    with rayload.load(tiny_llama, tp_size=4, method="scratch", device="auto") as result:
        bundles = result.placement.bundles
        assert len(bundles) == 4 and all(b.get("GPU") == 1.0 for b in bundles)
        views = result.apply(gpu_view)
    assert [v["rank"] for v in views] == [0, 1, 2, 3]
    visible = [v["cuda_visible_devices"] for v in views]
    assert sorted(visible) == ["0", "1", "2", "3"], "every rank sees exactly its own GPU"
    assert all([v["cuda_visible_devices"]] == v["gpu_ids"] for v in views)
    # Fake GPUs: torch sees no CUDA, so "auto" falls to the CPU rather than cuda:{rank}.
    assert {v["device"] for v in views} == {"cpu"}


def test_load_with_device_cpu_uses_cpu_bundles_on_gpu_cluster(
    tiny_llama: Path, no_leaks: object
) -> None:
    with rayload.load(tiny_llama, tp_size=2, method="scratch", device="cpu") as result:
        assert all("GPU" not in b for b in result.placement.bundles)
        assert result.apply(lambda state: ray.get_gpu_ids()) == [[], []]


def test_load_reports_metrics_trace_and_node_per_rank(
    tiny_llama: Path, tmp_path: Path, no_leaks: object
) -> None:
    with rayload.load(tiny_llama, 2, device="cpu", trace_dir=tmp_path) as result:
        node = ray.get_runtime_context().get_node_id()
        assert [r.node_id for r in result.ranks] == [node, node]
        assert result.placement.node_ids() == {0: node, 1: node}
        assert len(result.trace_id) == 32
        metrics = result.startup_metrics
        assert [m["rank"] for m in metrics["ranks"]] == [0, 1]
        assert all(m["actor_startup_seconds"] > 0 for m in metrics["ranks"])
        assert metrics["aggregate"]["bytes_read"]["max"] > 0
        assert set(result.trace_files) == {"otlp", "jaeger", "chrome", "html"}
        assert result.warnings == []


def test_ranks_that_resolve_differently_are_each_reported_and_load_right(
    mixed_dtype_checkpoint: Path,
    reference_shard: Callable[..., torch.Tensor],
    set_test_hooks: Callable[..., None],
    tmp_path: Path,
    no_leaks: object,
) -> None:
    # Rank 1's node "lacks" fastsafetensors (a TEST HOOK on its probe), rank 0's has it.
    hidden = {"fastsafetensors_version": None, "fastsafetensors_error": "hidden by a hook"}
    set_test_hooks(probe_overrides={"1": hidden})
    plan = plan_shards(mixed_dtype_checkpoint, 2)
    with rayload.load(
        mixed_dtype_checkpoint, 2, method="fastsafetensors", device="cpu", trace_dir=tmp_path
    ) as result:
        ran = [(r.method.selected.value, r.method.effective.value) for r in result.ranks]
        assert ran == [("fastsafetensors", "fastsafetensors"), ("scratch", "scratch")]
        assert result.ranks[0].method.fallback_reason is None
        assert "hidden by a hook" in (result.ranks[1].method.fallback_reason or "")
        assert any("fastsafetensors" in w and "scratch" in w for w in result.warnings)
        metrics = result.startup_metrics
        assert [m["method"] for m in metrics["ranks"]] == ["fastsafetensors", "scratch"]
        assert metrics["method"] == "fastsafetensors,scratch"  # never one rank's tag for all
        for rank in (0, 1):
            for name, split in plan.splits.items():
                got = result.shard(rank, name)
                want = reference_shard(mixed_dtype_checkpoint, rank, 2, name, split)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (rank, name)


def test_apply_runs_on_every_rank_with_its_resident_weights(
    tiny_llama: Path, no_leaks: object
) -> None:
    def summary(state: RankState, scale: int) -> tuple[int, int, int]:
        return state.rank, state.tp_size, scale * len(state.tensors)

    with rayload.load(tiny_llama, 2, method="scratch", device="cpu") as result:
        count = len(result.plan.ranks[0].shards)
        assert result.apply(summary, 10) == [(0, 2, 10 * count), (1, 2, 10 * count)]


def test_close_is_idempotent_and_releases_actors_and_group(
    tiny_llama: Path, no_leaks: object
) -> None:
    result = rayload.load(tiny_llama, 2, method="dummy", device="cpu")
    group_id = result.placement.group.id.hex()
    result.close()
    result.close()
    assert result.actors == []
    with pytest.raises(RuntimeError, match="is closed"):
        result.shard(0, "model.norm.weight")
    assert ray.util.placement_group_table()[group_id]["state"] == "REMOVED"


def test_shard_of_unknown_tensor_names_rank_and_tensor(tiny_llama: Path, no_leaks: object) -> None:
    with (
        rayload.load(tiny_llama, 2, method="dummy", device="cpu") as result,
        pytest.raises(KeyError, match="rank 1 holds no tensor 'nope'"),
    ):
        result.shard(1, "nope")


def test_load_with_rules_file_applies_it_on_every_rank(
    tiny_llama: Path, tmp_path: Path, no_leaks: object
) -> None:
    rules = tmp_path / "replicate-all.json"
    rules.write_text('{"rules": [{"pattern": ".*", "split": "replicate"}]}')
    full = plan_shards(tiny_llama, 1).ranks[0].shards
    with rayload.load(tiny_llama, 2, method="dummy", device="cpu", rules=str(rules)) as result:
        for shard in full:
            assert result.plan.split_dim(shard.name) is None
            assert tuple(result.shard(1, shard.name).shape) == shard.full_shape


def test_load_draft_model_prefixes_metric_keys(tiny_llama: Path, no_leaks: object) -> None:
    with rayload.load(tiny_llama, 1, method="dummy", device="cpu", model_role="draft") as result:
        assert result.startup_metrics["model_role"] == "draft"
        assert "draft_total_model_loading_seconds" in result.startup_metrics["aggregate"]
        assert result.ranks[0].model_role == "draft"
