"""``rayload.import_clock`` times torch's direct child imports, in a fresh interpreter
(the timer runs once, when the module is first imported), and leaves no trace of itself."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from typing import Any

import pytest

from rayload.import_clock import MIN_CHILD_IMPORT_NS

COVERAGE = 0.90

_REPORT = """
import json, sys
from rayload import import_clock as clock

def leftovers():
    return sorted(
        name
        for name, module in list(sys.modules.items())
        for loader in (
            getattr(module, "__loader__", None),
            getattr(getattr(module, "__spec__", None), "loader", None),
        )
        if isinstance(loader, clock._TimedLoader)
    )

def loaders(names):
    return {
        name: [
            type(sys.modules[name].__loader__).__name__,
            sys.modules[name].__loader__ is sys.modules[name].__spec__.loader,
        ]
        for name in names
        if name in sys.modules
    }
"""


# One fresh interpreter for every test here (each would pay for importing torch again), in
# this order: what the import left (nothing may run before it), then a timer asked for an
# already imported package, then a broken clock (last: it replaces the module's clock).
_REPORTS = """
report = {"imported": {
    "start": clock.IMPORT_START_NS,
    "end": clock.TORCH_IMPORTED_NS,
    "records": clock.TORCH_CHILD_IMPORTS,
    "loaders": loaders(["torch"] + [m for m, _, _ in clock.TORCH_CHILD_IMPORTS]),
    "leftovers": leftovers(),
    "finders": [type(f).__name__ for f in sys.meta_path],
}}
report["already_imported"] = {"records": clock._import_timed("torch")}

class Broken:
    def time_ns(self):
        raise RuntimeError("broken clock")

before = "email.mime.text" in sys.modules
clock.time = Broken()
records = clock._import_timed("email.mime.text")
import email.mime.text
report["broken_clock"] = {
    "records": records,
    "before": before,
    "imported": "email.mime.text" in sys.modules,
    "leftovers": leftovers(),
    "finders": [type(f).__name__ for f in sys.meta_path],
}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def reports() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _REPORT + _REPORTS],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_import_clock_times_torch_children_inside_its_import_without_overlap(
    reports: dict[str, Any],
) -> None:
    report = reports["imported"]
    records = report["records"]
    assert records, "no child of torch's import was timed"
    names = [m for m, _, _ in records]
    assert "torch._C" in names and "torch" not in names
    assert all(b - a >= MIN_CHILD_IMPORT_NS for _, a, b in records)
    assert all(report["start"] <= a <= b <= report["end"] for _, a, b in records)
    assert all(prev[2] <= nxt[1] for prev, nxt in itertools.pairwise(records))
    covered = sum(b - a for _, a, b in records)
    assert covered >= COVERAGE * (report["end"] - report["start"]), covered
    assert report["leftovers"] == []
    assert "_ChildImportTimer" not in report["finders"]
    for name, (loader_type, same_as_spec) in report["loaders"].items():
        assert loader_type != "_TimedLoader" and same_as_spec, name
    assert report["loaders"]["torch._C"][0] == "ExtensionFileLoader"


def test_import_clock_timer_that_fails_imports_untimed_and_reports_nothing(
    reports: dict[str, Any],
) -> None:
    report = reports["broken_clock"]
    assert report["records"] == []
    assert not report["before"] and report["imported"]
    assert report["leftovers"] == []
    assert "_ChildImportTimer" not in report["finders"]


def test_import_clock_times_nothing_of_an_already_imported_package(
    reports: dict[str, Any],
) -> None:
    assert reports["already_imported"]["records"] == []
