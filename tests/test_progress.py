from __future__ import annotations

import dataclasses
import io

from rayload.cli_output import LineProgress, format_rank_table
from rayload.loading.methods import LoadMethod, MethodReport
from rayload.loading.report import RankReport, mixed_method_warnings
from rayload.progress import LoadProgress

SCRATCH = LoadMethod.SCRATCH


def _report(
    rank: int, effective: LoadMethod = SCRATCH, device: str = "cpu", fallback: str | None = None
) -> RankReport:
    selected = LoadMethod.FASTSAFETENSORS if fallback else effective
    return RankReport(
        rank=rank,
        tp_size=2,
        device=device,
        method=MethodReport(LoadMethod.AUTO, selected, effective, fallback),
        bytes_read=3 * 1024 * 1024,
        tensors=5,
        start_ns=0,
        end_ns=1_500_000_000,
        node_id=f"{rank}" * 56,
    )


def test_mixed_method_warnings_empty_when_ranks_agree() -> None:
    assert mixed_method_warnings([_report(0), _report(1)]) == []


def test_mixed_method_warnings_names_methods_devices_and_fallbacks() -> None:
    warnings = mixed_method_warnings(
        [_report(0), _report(1, LoadMethod.DUMMY, device="cuda:0", fallback="no GDS")]
    )
    assert warnings == [
        "ranks loaded with different methods: scratch on ranks [0]; dummy on ranks [1]",
        "ranks loaded onto different devices: cpu on ranks [0]; cuda:0 on ranks [1]",
        "rank 1 fell back: auto -> fastsafetensors -> dummy: no GDS",
    ]


def test_mixed_method_warnings_fallback_names_requested_then_selected() -> None:
    gdr, fst = LoadMethod.FASTSAFETENSORS_GDR, LoadMethod.FASTSAFETENSORS
    reason = "GPUDirect Storage copies into GPU memory but the device is cpu"
    report = RankReport(
        rank=0,
        tp_size=1,
        device="cpu",
        method=MethodReport(gdr, fst, fst, reason),
        bytes_read=0,
        tensors=0,
        start_ns=0,
        end_ns=1,
    )
    assert mixed_method_warnings([report]) == [
        f"rank 0 fell back: fastsafetensors_gdr -> fastsafetensors: {reason}"
    ]


def test_format_rank_table_has_one_aligned_row_per_rank() -> None:
    lines = format_rank_table([_report(1), _report(0)]).splitlines()
    assert lines[0].split() == [
        "rank", "node", "device", "requested", "selected", "effective", "fallback",
        "bytes", "peer_bytes", "seconds",
    ]  # fmt: skip
    assert [line.split()[:2] for line in lines[1:]] == [["0", "0" * 8], ["1", "1" * 8]]
    assert lines[1].split()[-4:] == ["3.00", "MiB", "-", "1.500"]
    assert all(line.index("cpu") == lines[0].index("device") for line in lines[1:])


def test_format_rank_table_shows_bytes_from_peers() -> None:
    from_peer = dataclasses.replace(_report(0), bytes_read=0, bytes_from_peers=2 * 1024 * 1024)
    row = format_rank_table([from_peer]).splitlines()[1].split()
    assert row[-5:] == ["0", "B", "2.00", "MiB", "1.500"]


def test_line_progress_prints_one_line_per_event_without_carriage_returns() -> None:
    out = io.StringIO()
    show = LineProgress(out)
    show(LoadProgress("placed", 2))
    show(LoadProgress("rank_loaded", 2, rank=1, node_id="f" * 56, bytes_read=2048,
                      seconds=0.25, method="scratch", done=1))  # fmt: skip
    lines = out.getvalue().splitlines()
    assert lines == [
        "rayload: placement group ready for 2 rank(s)",
        "rayload: rank 1 loaded 2.00 KiB in 0.25 s with scratch on node ffffffff [1/2]",
    ]
    assert "\r" not in out.getvalue()
