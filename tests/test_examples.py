"""The examples use the public API only: every name they import from rayload is listed
in that module's ``__all__``.

``__all__`` is read from each module's source, not by importing it, so that an example of an
optional extra (``serve_vllm.py`` imports :mod:`rayload.integrations.vllm`, which needs vLLM)
is checked in the main environment too.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.py"))


def _public_names(module: str) -> list[str]:
    """The literal ``__all__`` of ``module``'s source (a module without one exports nothing)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} not found"
    tree = ast.parse(Path(spec.origin).read_text(), filename=spec.origin)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_imports_only_public_rayload_names(example: Path) -> None:
    tree = ast.parse(example.read_text(), filename=str(example))
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rayload"):
            public = _public_names(node.module or "")
            private += [f"{node.module}.{a.name}" for a in node.names if a.name not in public]
    assert private == []


def test_a_name_missing_from_all_is_found() -> None:
    assert "reload_in_place" in _public_names("rayload.integrations.vllm")
    assert "_checkpoint" not in _public_names("rayload.integrations.vllm")
    assert _public_names("rayload") == [
        "LoadConfig",
        "LoadMethod",
        "LoadResult",
        "RayloadError",
        "load",
    ]


def test_examples_are_found() -> None:
    assert len(EXAMPLES) >= 3
