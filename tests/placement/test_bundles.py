from __future__ import annotations

import pytest

from rayload.errors import ConfigError
from rayload.placement.bundles import (
    bundle_index,
    check_reused_bundles,
    format_resources,
    rank_bundles,
    rank_resources,
    unmet_resources,
)


def test_rank_bundles_one_gpu_bundle_per_rank_with_gpus() -> None:
    assert rank_bundles(3, use_gpus=True, cpus_per_rank=0.5) == [{"CPU": 0.5, "GPU": 1.0}] * 3


def test_rank_bundles_cpu_only_without_gpus() -> None:
    assert rank_bundles(2, use_gpus=False, cpus_per_rank=0.01) == [{"CPU": 0.01}] * 2


@pytest.mark.parametrize(("tp", "cpus"), [(0, 1.0), (-1, 1.0), (2, 0.0)])
def test_rank_bundles_rejects_bad_sizes(tp: int, cpus: float) -> None:
    with pytest.raises(ConfigError):
        rank_bundles(tp, use_gpus=False, cpus_per_rank=cpus)


def test_bundle_index_is_rank_in_own_group() -> None:
    assert [bundle_index(r) for r in range(4)] == [0, 1, 2, 3]


def test_bundle_index_skips_bundle_zero_in_reused_group() -> None:
    assert [bundle_index(r, first_rank_bundle=1) for r in range(4)] == [1, 2, 3, 4]


def test_bundle_index_rejects_negative_rank() -> None:
    with pytest.raises(ValueError, match="rank"):
        bundle_index(-1)


def test_rank_resources_takes_gpu_only_when_bundle_has_one_and_wanted() -> None:
    gpu_bundle = {"CPU": 0.25, "GPU": 1.0}
    assert rank_resources(gpu_bundle, want_gpu=True).num_gpus == 1.0
    assert rank_resources(gpu_bundle, want_gpu=False).num_gpus == 0.0
    assert rank_resources({"CPU": 0.25}, want_gpu=True).num_gpus == 0.0
    assert rank_resources(gpu_bundle, want_gpu=True).num_cpus == 0.25


def test_check_reused_bundles_accepts_replica_plus_ranks() -> None:
    check_reused_bundles([{"CPU": 1}, {"GPU": 1}, {"GPU": 1}], 2, need_gpus=True)


def test_check_reused_bundles_rejects_too_few_bundles() -> None:
    with pytest.raises(ConfigError, match=r"3 bundles.*bundle 0 .* plus 3 rank bundles"):
        check_reused_bundles([{"CPU": 1}, {"CPU": 1}, {"CPU": 1}], 3, need_gpus=False)


def test_check_reused_bundles_rejects_gpu_less_rank_bundle_for_cuda() -> None:
    with pytest.raises(ConfigError, match=r"bundle 2 .* no GPU"):
        check_reused_bundles([{"CPU": 1}, {"GPU": 1}, {"CPU": 1}], 2, need_gpus=True)


def test_unmet_resources_strict_pack_needs_one_node() -> None:
    bundles = rank_bundles(4, use_gpus=True, cpus_per_rank=0.01)
    two_nodes = [{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2}]
    assert "no single node" in (unmet_resources(bundles, "STRICT_PACK", two_nodes) or "")
    assert unmet_resources(bundles, "PACK", two_nodes) is None
    assert unmet_resources(bundles, "SPREAD", two_nodes) is None


def test_unmet_resources_strict_spread_needs_distinct_nodes() -> None:
    bundles = rank_bundles(3, use_gpus=False, cpus_per_rank=1)
    assert unmet_resources(bundles, "STRICT_SPREAD", [{"CPU": 8}] * 2) is not None
    assert unmet_resources(bundles, "STRICT_SPREAD", [{"CPU": 8}] * 3) is None


def test_unmet_resources_reports_missing_gpus() -> None:
    reason = unmet_resources(rank_bundles(8, use_gpus=True), "PACK", [{"CPU": 2, "GPU": 4}])
    assert reason is not None and "GPU: 8" in reason


def test_unmet_resources_rejects_unknown_strategy() -> None:
    with pytest.raises(ConfigError, match="placement strategy"):
        unmet_resources([{"CPU": 1}], "BEST_EFFORT", [{"CPU": 1}])


def test_format_resources_hides_memory_and_node_keys() -> None:
    shown = format_resources({"CPU": 2.0, "GPU": 4.0, "memory": 1e9, "node:10.0.0.1": 1.0})
    assert shown == "{CPU: 2, GPU: 4}"
