"""The examples use the public API only: every name they import from rayload is listed
in that module's ``__all__``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_imports_only_public_rayload_names(example: Path) -> None:
    tree = ast.parse(example.read_text(), filename=str(example))
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rayload"):
            module = importlib.import_module(node.module or "")
            public = getattr(module, "__all__", ())
            private += [f"{node.module}.{a.name}" for a in node.names if a.name not in public]
    assert private == []


def test_examples_are_found() -> None:
    assert len(EXAMPLES) >= 3
