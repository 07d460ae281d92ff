"""``rayload.import_clock`` times torch's direct child imports, in a fresh interpreter
(the timer runs once, when the module is first imported), and leaves no trace of itself."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from typing import Any

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


def _run(body: str) -> dict[str, Any]:
    code = _REPORT + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_import_clock_times_torch_children_inside_its_import_without_overlap() -> None:
    report = _run(
        """
        records = clock.TORCH_CHILD_IMPORTS
        print(json.dumps({
            "start": clock.IMPORT_START_NS,
            "end": clock.TORCH_IMPORTED_NS,
            "records": records,
            "loaders": loaders(["torch"] + [m for m, _, _ in records]),
            "leftovers": leftovers(),
            "finders": [type(f).__name__ for f in sys.meta_path],
        }))
        """
    )
    records = report["records"]
    assert records, "no child of torch's import was timed"
    names = [m for m, _, _ in records]
    assert "torch._C" in names and "torch" not in names
    assert all(b - a >= 5_000_000 for _, a, b in records)
    assert all(report["start"] <= a <= b <= report["end"] for _, a, b in records)
    assert all(prev[2] <= nxt[1] for prev, nxt in itertools.pairwise(records))
    covered = sum(b - a for _, a, b in records)
    assert covered >= COVERAGE * (report["end"] - report["start"]), covered
    assert report["leftovers"] == []
    assert "_ChildImportTimer" not in report["finders"]
    for name, (loader_type, same_as_spec) in report["loaders"].items():
        assert loader_type != "_TimedLoader" and same_as_spec, name
    assert report["loaders"]["torch._C"][0] == "ExtensionFileLoader"


def test_import_clock_timer_that_fails_imports_untimed_and_reports_nothing() -> None:
    report = _run(
        """
        class Broken:
            def time_ns(self):
                raise RuntimeError("broken clock")

        before = "email.mime.text" in sys.modules
        clock.time = Broken()
        records = clock._import_timed("email.mime.text")
        import email.mime.text
        print(json.dumps({
            "records": records,
            "before": before,
            "imported": "email.mime.text" in sys.modules,
            "leftovers": leftovers(),
            "finders": [type(f).__name__ for f in sys.meta_path],
        }))
        """
    )
    assert report["records"] == []
    assert not report["before"] and report["imported"]
    assert report["leftovers"] == []
    assert "_ChildImportTimer" not in report["finders"]


def test_import_clock_times_nothing_of_an_already_imported_package() -> None:
    report = _run('print(json.dumps({"records": clock._import_timed("torch")}))')
    assert report["records"] == []
