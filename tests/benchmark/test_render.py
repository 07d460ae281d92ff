"""Writing a result: JSON that round-trips, markdown with every case, a real PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rayload.benchmark import write_report


def test_write_report_writes_json_markdown_and_png(
    bench_result: dict[str, Any], tmp_path: Path
) -> None:
    paths = write_report(bench_result, tmp_path / "out")
    assert set(paths) == {"json", "md", "png"}
    assert json.loads(paths["json"].read_text()) == bench_result
    md = paths["md"].read_text()
    for section in ("## cold page cache", "## warm page cache", "## Targets"):
        assert section in md
    for s in bench_result["summary"]:
        assert f"| {s['case']} | {s['tp_size']} |" in md
    assert f"]({paths['png'].name})" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
