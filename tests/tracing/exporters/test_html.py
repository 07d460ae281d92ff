"""trace.html rendered by a real headless Chromium: lanes, slowest rank, fallbacks, errors.

Needs Debian's ``chromium`` (``scripts/install-system-deps.sh`` installs it); skipped with
that reason where it is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from rayload.tracing import StartupTrace, render_html, write_trace_files

_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        _CHROMIUM is None,
        reason="chromium is not installed: run scripts/install-system-deps.sh "
        "(apt-get install chromium)",
    ),
]
_VOID = {"meta", "link", "br", "img", "input", "hr", "col", "area", "base", "source", "wbr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def find_all(self, predicate: Callable[[Node], bool]) -> list[Node]:
        found = [self] if predicate(self) else []
        for child in self.children:
            found.extend(child.find_all(predicate))
        return found

    def by_class(self, name: str) -> list[Node]:
        return self.find_all(lambda n: name in n.classes)

    def all_text(self) -> str:
        return "".join(self.text) + "".join(c.all_text() for c in self.children)


class _DomBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Node("#document", {})
        self._stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self._stack[-1].children.append(node)
        if tag not in _VOID:
            self._stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self._stack) - 1, 0, -1):
            if self._stack[depth].tag == tag:
                del self._stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        self._stack[-1].text.append(data)


def _chromium(html: Path, tmp_path: Path, *extra: str) -> str:
    assert _CHROMIUM is not None
    command = [
        _CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1400,700",
        *extra,
        html.resolve().as_uri(),
    ]
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=120).stdout


def _rendered(spans: list[Any], tmp_path: Path) -> Node:
    paths = write_trace_files(spans, tmp_path / "trace")
    builder = _DomBuilder()
    builder.feed(_chromium(paths["html"], tmp_path, "--dump-dom"))
    return builder.root


def _lanes(dom: Node) -> dict[str, Node]:
    return {n.attrs["data-lane"]: n for n in dom.find_all(lambda n: "data-lane" in n.attrs)}


@pytest.fixture(scope="module")
def tp4_dom(make_tp4_trace: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Node:
    return _rendered(make_tp4_trace().spans, tmp_path_factory.mktemp("html"))


def test_html_draws_driver_lane_then_one_lane_per_rank(tp4_dom: Node) -> None:
    lanes = _lanes(tp4_dom)
    assert list(lanes) == ["driver", "rank-0", "rank-1", "rank-2", "rank-3"]
    for rank in range(4):
        bars = [n.attrs["data-span"] for n in lanes[f"rank-{rank}"].by_class("bar")]
        assert sorted(bars) == sorted(
            [
                "rank.load",
                "rank.resolve",
                "rank.plan",
                "rank.read",
                "rank.to_device",
                "rank.sync",
                "rank.post_load",
            ]
        )
        assert f"rank {rank} (node {rank:02d}" in lanes[f"rank-{rank}"].all_text()
    driver_bars = [n.attrs["data-span"] for n in lanes["driver"].by_class("bar")]
    assert driver_bars.count("rayload.spawn") == 4
    assert {"rayload.load", "rayload.placement"} <= set(driver_bars)


def test_html_highlights_slowest_rank_only(tp4_dom: Node) -> None:
    lanes = _lanes(tp4_dom)
    marked = [key for key, lane in lanes.items() if lane.by_class("slowest-marker")]
    assert marked == ["rank-2"]
    assert "slowest" in lanes["rank-2"].classes
    assert "rank 2" in tp4_dom.by_class("summary")[0].all_text()


def test_html_writes_out_fallback_reason(tp4_dom: Node, tp4_trace: Any) -> None:
    lanes = _lanes(tp4_dom)
    [marker] = lanes["rank-1"].by_class("fallback-marker")
    assert tp4_trace.fallback_reason in marker.all_text()
    assert "fallback" in marker.all_text()
    assert not any(lanes[key].by_class("fallback-marker") for key in lanes if key != "rank-1")


def test_html_has_legend_and_time_axis(tp4_dom: Node) -> None:
    legend = tp4_dom.by_class("legend-item")
    assert {"rank.read", "rank.to_device", "rank.sync"} <= {n.all_text() for n in legend}
    ticks = [n.all_text() for n in tp4_dom.by_class("tick")]
    assert ticks[0] == "0" and len(ticks) >= 4
    assert any(t.endswith("ms") for t in ticks)


def test_html_marks_failed_and_missing_ranks(
    make_tp4_trace: Callable[..., Any], tmp_path: Path
) -> None:
    dom = _rendered(make_tp4_trace(missing_rank=3, failed_rank=0).spans, tmp_path)
    lanes = _lanes(dom)
    [missing] = lanes["rank-3"].by_class("error-marker")
    assert "actor died" in missing.all_text()
    [failed] = lanes["rank-0"].by_class("error-marker")
    assert "Input/output error" in failed.all_text()
    assert lanes["rank-0"].find_all(lambda n: "bar" in n.classes and "error" in n.classes)


def test_html_is_self_contained_and_escapes_attributes(tmp_path: Path) -> None:
    trace = StartupTrace(tp_size=1)
    hostile = "</script><b id='injected'>x</b><script>document.title='pwned'</script>"
    trace.add_span("rayload.placement", 0, 1, {"strategy": hostile})
    page = render_html(trace.finish())
    assert not re.search(r"""(src|href)\s*=|https?://|<link|@import|fetch\(|XMLHttpRequest""", page)
    (tmp_path / "t.html").write_text(page)
    builder = _DomBuilder()
    builder.feed(_chromium(tmp_path / "t.html", tmp_path, "--dump-dom"))
    assert not builder.root.find_all(lambda n: n.attrs.get("id") == "injected")
    assert list(_lanes(builder.root)) == ["driver"]


def test_html_screenshot_renders(make_tp4_trace: Callable[..., Any], tmp_path: Path) -> None:
    paths = write_trace_files(make_tp4_trace().spans, tmp_path / "trace")
    shot = tmp_path / "trace.png"
    _chromium(paths["html"], tmp_path, f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000  # a drawn page, not a blank one
