"""Startup metrics from hand-built RankReports: keys, aggregates, draft prefix, table."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from rayload.loading.methods import LoadMethod, MethodReport
from rayload.loading.report import PhaseRecord, RankReport
from rayload.tracing import format_metrics_table, publish_ray_metrics, startup_metrics

S = 1_000_000_000
KEYS = [
    "total_model_loading_seconds",
    "checkpoint_preparation_seconds",
    "weight_population_seconds",
    "post_load_processing_seconds",
    "actor_startup_seconds",
    "placement_seconds",
    "bytes_read",
    "read_gbps",
    "bytes_from_storage",
    "bytes_from_peers",
]
SCRATCH = MethodReport(LoadMethod.AUTO, LoadMethod.SCRATCH, LoadMethod.SCRATCH)
FALLBACK = MethodReport(
    LoadMethod.FASTSAFETENSORS_GDR,
    LoadMethod.FASTSAFETENSORS_GDR,
    LoadMethod.FASTSAFETENSORS,
    "cuFile is not available",
)


def _report(rank: int, seconds: dict[str, float], *, method: MethodReport = SCRATCH) -> RankReport:
    """A rank whose phases run back to back for ``seconds``, after 0.5 s of config parsing."""
    start = 100 * S
    cursor = start + S // 2
    phases = []
    for name, length in seconds.items():
        phases.append(PhaseRecord(name, cursor, cursor + int(length * S)))
        cursor += int(length * S)
    return RankReport(
        rank=rank,
        tp_size=2,
        device="cpu",
        method=method,
        bytes_read=4 * S,
        tensors=10,
        start_ns=start,
        end_ns=cursor,
        phases=tuple(phases),
        node_id=f"node{rank}",
    )


REPORTS = [
    _report(
        0,
        {
            "rank.resolve": 0.25,
            "rank.plan": 0.25,
            "rank.read": 2.0,
            "rank.to_device": 0.5,
            "rank.sync": 0.25,
            "rank.post_load": 0.25,
        },
    ),
    _report(
        1,
        {
            "rank.resolve": 0.5,
            "rank.plan": 0.5,
            "rank.read": 4.0,
            "rank.to_device": 1.0,
            "rank.sync": 0.5,
            "rank.post_load": 1.0,
        },
        method=FALLBACK,
    ),
]


def _metrics(model_role: str = "main") -> dict:
    return startup_metrics(
        REPORTS,
        placement_seconds=0.75,
        actor_startup_seconds={0: 2.0, 1: 3.0},
        model_role=model_role,
    )


def test_per_rank_figures_from_phases() -> None:
    rank0, rank1 = _metrics()["ranks"]
    assert rank0 == {
        "rank": 0,
        "replica": 0,
        "node_id": "node0",
        "method": "scratch",
        "fallback_reason": None,
        "peer_switch": None,
        "total_model_loading_seconds": 4.0,  # includes 0.5 s of config parsing
        "checkpoint_preparation_seconds": 0.5,
        "weight_population_seconds": 2.75,
        "post_load_processing_seconds": 0.25,
        "actor_startup_seconds": 2.0,
        "placement_seconds": 0.75,
        "bytes_read": 4 * S,
        "read_gbps": 2.0,
        "bytes_from_storage": 4 * S,
        "bytes_from_peers": 0,
        "phases": {
            "rank.resolve": 0.25,
            "rank.plan": 0.25,
            "rank.read": 2.0,
            "rank.to_device": 0.5,
            "rank.sync": 0.25,
            "rank.post_load": 0.25,
        },
    }
    assert rank1["method"] == "fastsafetensors"
    assert rank1["fallback_reason"] == "cuFile is not available"
    assert rank1["read_gbps"] == 1.0


def test_aggregate_max_mean_slowest_rank_and_method_tag() -> None:
    metrics = _metrics()
    assert metrics["model_role"] == "main"
    assert metrics["method"] == "fastsafetensors,scratch"
    assert metrics["slowest_rank"] == 1
    aggregate = metrics["aggregate"]
    assert list(aggregate) == KEYS
    assert aggregate["total_model_loading_seconds"] == {
        "max": 8.0,
        "mean": 6.0,
        "min": 4.0,
        "slowest_rank": 1,
        "method": "fastsafetensors,scratch",
    }
    assert aggregate["read_gbps"]["slowest_rank"] == 1  # the lowest throughput is the worst
    assert aggregate["read_gbps"]["max"] == 2.0
    assert aggregate["placement_seconds"]["slowest_rank"] is None  # driver-wide
    assert aggregate["bytes_read"]["mean"] == 4 * S
    assert aggregate["bytes_read"]["slowest_rank"] is None  # more bytes is not slower


def test_byte_aggregates_sum_storage_and_peer_bytes_over_ranks() -> None:
    from_peer = dataclasses.replace(REPORTS[0], bytes_read=0, bytes_from_peers=3 * S)
    metrics = startup_metrics(
        [from_peer, REPORTS[1]], placement_seconds=0.0, actor_startup_seconds={}
    )
    aggregate = metrics["aggregate"]
    assert aggregate["bytes_from_peers"] == {
        "max": 3 * S,
        "mean": 3 * S // 2,
        "min": 0,
        "slowest_rank": None,
        "method": "fastsafetensors,scratch",
        "total": 3 * S,
    }
    assert aggregate["bytes_from_storage"]["total"] == aggregate["bytes_read"]["total"] == 4 * S
    assert [r["bytes_from_peers"] for r in metrics["ranks"]] == [3 * S, 0]
    table = format_metrics_table(metrics)
    row0 = table.splitlines()[2].split()
    assert row0[-3:] == ["0.000", "3.000", "0.000"]  # GB from storage, peer_GB, GB/s


def test_read_gbps_aggregate_total_is_all_bytes_over_longest_population() -> None:
    aggregate = _metrics()["aggregate"]
    # 2 ranks x 4 GB over rank 1's 4.0 + 1.0 + 0.5 s of weight population
    assert aggregate["read_gbps"]["total"] == round(8 / 5.5, 3)
    assert "total" not in aggregate["total_model_loading_seconds"]
    assert _metrics("draft")["aggregate"]["draft_read_gbps"]["total"] == round(8 / 5.5, 3)


def test_draft_role_prefixes_every_metric_key() -> None:
    metrics = _metrics("draft")
    assert list(metrics["aggregate"]) == [f"draft_{key}" for key in KEYS]
    rank = metrics["ranks"][0]
    assert all(f"draft_{key}" in rank and key not in rank for key in KEYS)
    assert metrics["slowest_rank"] == 1
    assert "draft placement" in format_metrics_table(metrics)


def test_missing_actor_startup_is_none_and_left_out_of_aggregate() -> None:
    metrics = startup_metrics(REPORTS, placement_seconds=0.1, actor_startup_seconds={1: 3.0})
    assert metrics["ranks"][0]["actor_startup_seconds"] is None
    assert metrics["aggregate"]["actor_startup_seconds"]["mean"] == 3.0


def test_rank_without_read_reports_zero_gbps() -> None:
    report = _report(0, {"rank.resolve": 0.1})
    metrics = startup_metrics([report], placement_seconds=0.0, actor_startup_seconds={0: 1.0})
    assert metrics["ranks"][0]["read_gbps"] == 0.0


def test_no_reports_raise_value_error() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        startup_metrics([], placement_seconds=0.0, actor_startup_seconds={})


def test_table_has_rank_rows_phase_columns_and_notes() -> None:
    table = format_metrics_table(_metrics())
    header, rule, row0, row1, *rest = table.splitlines()
    assert header.split() == [
        "rank", "method", "actor", "resolve", "plan", "read", "to_device", "sync",
        "post_load", "total", "GB", "peer_GB", "GB/s",
    ]  # fmt: skip
    assert set(rule.replace(" ", "")) == {"-"}
    assert row0.split() == [
        "0", "scratch", "2.000", "0.250", "0.250", "2.000", "0.500", "0.250", "0.250",
        "4.000", "4.000", "0.000", "2.000",
    ]  # fmt: skip
    assert row1.split()[0] == "1*"
    assert "placement 0.750 s" in table
    assert "rank 1 fell back: cuFile is not available" in rest


def test_publish_ray_metrics_without_ray_is_a_logged_no_op(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    with caplog.at_level(logging.DEBUG, logger="rayload.tracing.metrics"):
        publish_ray_metrics(_metrics())
    assert "not initialized" in caplog.text


@pytest.mark.slow
def test_publish_ray_metrics_reach_ray_prometheus_endpoint() -> None:
    """A real local Ray: every per-rank figure appears on the node's metrics endpoint."""
    ray = pytest.importorskip("ray")
    own_cluster = not ray.is_initialized()
    if own_cluster:
        ray.init(  # its own Ray, even where `ray start` recorded a cluster on this machine
            address="local",
            num_cpus=1,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
            # Export recorded metrics every second (Ray's floor), not every 10 s: the
            # scrape below waits for the first export.
            _system_config={"metrics_report_interval_ms": 1000},
        )
    try:
        publish_ray_metrics(_metrics())
        port = ray._private.worker.global_worker.node.metrics_export_port
        # 2 ranks x (7 per-rank keys + 6 phases) + placement once
        series = _scrape_rayload_series(port, expected=2 * (len(KEYS) - 1 + 6) + 1)
    finally:
        if own_cluster:
            ray.shutdown()
    assert any(
        line.startswith("ray_rayload_total_model_loading_seconds{")
        and 'rank="1"' in line
        and 'method="fastsafetensors"' in line
        and line.endswith(" 8.0")
        for line in series
    )
    assert any('phase="rank.read"' in line and 'rank="0"' in line for line in series)
    assert any(
        line.startswith("ray_rayload_placement_seconds{") and 'rank="driver"' in line
        for line in series
    )


def _scrape_rayload_series(port: int, *, expected: int, timeout_s: float = 60.0) -> list[str]:
    """The ``ray_rayload_*`` sample lines once at least ``expected`` are exported (Ray
    exports recorded metrics every few seconds)."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                body = reply.read().decode()
        except urllib.error.URLError:
            body = ""
        lines = [line for line in body.splitlines() if line.startswith("ray_rayload_")]
        if len(lines) >= expected:
            return lines
        time.sleep(1.0)
    return lines


def test_replicas_are_rows_of_their_own_and_only_the_slowest_is_marked() -> None:
    from dataclasses import replace

    fast = _report(1, {"rank.read": 1.0})
    slow = replace(_report(1, {"rank.read": 5.0}), replica=1)
    reports = [_report(0, {"rank.read": 1.0}), fast, replace(_report(0, {}), replica=1), slow]
    metrics = startup_metrics(reports, placement_seconds=0.0, actor_startup_seconds={})
    assert [(r["replica"], r["rank"]) for r in metrics["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    rows = format_metrics_table(metrics).splitlines()
    marked = [row.split()[0] for row in rows if row.split() and row.split()[0].endswith("*")]
    assert marked == ["1/1*"]
