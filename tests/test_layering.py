"""The package's layering, read from the source: no import cycle, and ``rayload.loading``
free of Ray.

Every module under ``src/rayload`` is parsed with :mod:`ast` (nothing is imported), and
every ``import x`` and ``from x import y`` becomes an edge, relative imports resolved.
``from pkg import name`` points at the submodule ``pkg.name`` when there is one, else at
``pkg``; an import names only the module it names (not the packages above it, which Python
has already initialized by then).

An import is *module-level* when it runs, or is read by the type checker, as the module
is imported: at the top, in a class body, under ``if``/``try``, and under
``if TYPE_CHECKING:`` too (a type-only import is still a dependency of the layer; a cycle
through one is a cycle of the design, even though Python never runs it). Imports inside a
function run later and are not part of the cycle check; they do count for the Ray check,
since ``loading/`` must run in a process without Ray at all.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "rayload"


RAY_FREE_PACKAGE = "rayload.loading"
FORBIDDEN_IN_RAY_FREE = ("ray", "rayload.actors")


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``source`` imports ``target`` at ``path:line``.

    ``target`` is a module of the package, or the name written for anything else.
    ``file`` is the source file, relative to the source root; ``scope`` is ``module``,
    ``type_checking`` or ``function`` (see the module docstring).
    """

    source: str
    target: str
    file: str
    line: int
    scope: str

    @property
    def module_level(self) -> bool:
        return self.scope != "function"

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def discover_modules(src: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` of ``package`` under ``src``."""
    modules: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def module_imports(name: str, src: Path, modules: Mapping[str, Path]) -> list[Import]:
    """Every import in the module ``name`` (found under ``src``), resolved against
    ``modules``."""
    path = modules[name]
    file = path.relative_to(src).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node, scope in _walk(tree, "module"):
        if isinstance(node, ast.Import):
            targets = [_known(alias.name, modules) for alias in node.names]
        else:
            base = _absolute(name, is_package, node.module, node.level)
            targets = [
                f"{base}.{alias.name}"
                if f"{base}.{alias.name}" in modules
                else _known(base, modules)
                for alias in node.names
            ]
        for target in dict.fromkeys(targets):
            found.append(Import(name, target, file, node.lineno, scope))
    return found


def _walk(node: ast.AST, scope: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, scope
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _walk(child, "function")
        elif scope == "module" and isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "type_checking")
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), scope)
        else:
            yield from _walk(child, scope)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(name: str, is_package: bool, module: str | None, level: int) -> str:
    """The absolute module a ``from`` import names (``level`` leading dots)."""
    if level == 0:
        assert module is not None
        return module
    parts = name.split(".") if is_package else name.split(".")[:-1]
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _known(target: str, modules: Mapping[str, Path]) -> str:
    """``target``, or the longest prefix of it that is a module of the package (an import
    of a name that is no module, e.g. ``import rayload.x.attr``, depends on its module)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return target


def import_graph(imports: Iterable[Import], modules: Mapping[str, Path]) -> dict[str, list[Import]]:
    """Module -> its module-level imports of other modules of the package."""
    graph: dict[str, list[Import]] = {name: [] for name in modules}
    for imp in imports:
        if imp.module_level and imp.target in modules and imp.target != imp.source:
            graph[imp.source].append(imp)
    return graph


def strongly_connected(graph: Mapping[str, list[Import]]) -> list[frozenset[str]]:
    """The components of ``graph`` holding a cycle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for edge in edges:
                if edge.target not in index:
                    index[edge.target] = low[edge.target] = len(index)
                    stack.append(edge.target)
                    on_stack.add(edge.target)
                    work.append((edge.target, iter(graph[edge.target])))
                    break
                if edge.target in on_stack:
                    low[node] = min(low[node], index[edge.target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.add(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        components.append(frozenset(members))
    return components


def cycle_through(component: frozenset[str], graph: Mapping[str, list[Import]]) -> list[Import]:
    """A shortest cycle inside ``component``, from its first module back to it."""
    start = min(component)
    came_by: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in graph[node]:
            if edge.target not in component:
                continue
            if edge.target == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, came_by[path[0].source])
                return path
            if edge.target not in came_by:
                came_by[edge.target] = edge
                queue.append(edge.target)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def describe_cycle(cycle: list[Import]) -> str:
    """``a -> b (a.py:3) -> a (b.py:7)``."""
    return " -> ".join([cycle[0].source] + [f"{edge.target} ({edge.where()})" for edge in cycle])


def _package_imports(
    src: Path = SRC, package: str = PACKAGE
) -> tuple[dict[str, Path], list[Import]]:
    modules = discover_modules(src, package)
    imports = [imp for name in modules for imp in module_imports(name, src, modules)]
    return modules, imports


def _cycles(src: Path = SRC, package: str = PACKAGE) -> dict[frozenset[str], str]:
    modules, imports = _package_imports(src, package)
    graph = import_graph(imports, modules)
    return {c: describe_cycle(cycle_through(c, graph)) for c in strongly_connected(graph)}


def _is_within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# --- the walker itself, on a package written for the test --------------------------------


@pytest.fixture
def toy_package(tmp_path: Path) -> Path:
    """``toy``: a cycle ``toy.a -> toy.sub.b -> toy.a`` through a relative import, a
    type-only edge, a function-level import and a ``from pkg import submodule``."""
    files = {
        "toy/__init__.py": "",
        "toy/a.py": "from toy.sub import b\nimport json\n",
        "toy/sub/__init__.py": "from . import c\n",
        "toy/sub/b.py": "from .. import a\n",
        "toy/sub/c.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from ..d import Thing\n"
            "def f():\n    import toy.a\n    from .b import x\n"
        ),
        "toy/d.py": "class Thing:\n    import ray.util\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_walker_resolves_relative_and_submodule_imports_with_their_scope(
    toy_package: Path,
) -> None:
    _, imports = _package_imports(toy_package, "toy")
    edges = {(i.source, i.target, i.scope) for i in imports}
    assert edges == {
        ("toy.a", "toy.sub.b", "module"),
        ("toy.a", "json", "module"),
        ("toy.sub", "toy.sub.c", "module"),
        ("toy.sub.b", "toy.a", "module"),
        ("toy.sub.c", "typing", "module"),
        ("toy.sub.c", "toy.d", "type_checking"),
        ("toy.sub.c", "toy.a", "function"),
        ("toy.sub.c", "toy.sub.b", "function"),
        ("toy.d", "ray.util", "module"),
    }


def test_cycle_check_reports_the_cycle_path_with_file_and_line(toy_package: Path) -> None:
    cycles = _cycles(toy_package, "toy")
    assert list(cycles.values()) == ["toy.a -> toy.sub.b (toy/a.py:1) -> toy.a (toy/sub/b.py:1)"]


# --- rayload --------------------------------------------------------------------------


def test_walker_sees_the_package() -> None:
    modules, imports = _package_imports()
    assert {"rayload", "rayload.api", "rayload.result", "rayload.loading", "rayload.cli"} <= set(
        modules
    )
    assert any(i.source == "rayload.result" and i.target == "ray" for i in imports)


def test_module_level_imports_have_no_cycle() -> None:
    cycles = _cycles()
    assert not cycles, "import cycles among module-level imports:\n" + "\n".join(cycles.values())


def test_loading_imports_neither_ray_nor_actors() -> None:
    """``rayload.loading`` runs in a plain process: none of its modules imports Ray or the
    rank actors, at module level or inside a function."""
    _, imports = _package_imports()
    bad = [
        f"{imp.where()}: {imp.source} imports {imp.target} ({imp.scope})"
        for imp in imports
        if _is_within(imp.source, RAY_FREE_PACKAGE)
        and any(_is_within(imp.target, forbidden) for forbidden in FORBIDDEN_IN_RAY_FREE)
    ]
    assert not bad, "loading/ must not depend on Ray:\n" + "\n".join(bad)


def test_loading_reaches_no_ray_through_other_modules() -> None:
    """No module that ``rayload.loading`` imports at run time (module level, transitively)
    imports Ray at module level: importing ``rayload.loading`` never imports Ray."""
    modules, imports = _package_imports()
    runtime = [imp for imp in imports if imp.scope == "module"]
    graph = import_graph(runtime, modules)
    reached: dict[str, list[str]] = {
        name: [name] for name in modules if _is_within(name, RAY_FREE_PACKAGE)
    }
    queue = deque(reached)
    while queue:
        node = queue.popleft()
        for edge in graph[node]:
            if edge.target not in reached:
                reached[edge.target] = [*reached[node], edge.target]
                queue.append(edge.target)
    bad = [
        f"{' -> '.join(reached[imp.source])} -> {imp.target} ({imp.where()})"
        for imp in runtime
        if imp.source in reached and _is_within(imp.target, "ray")
    ]
    assert not bad, "importing rayload.loading imports Ray:\n" + "\n".join(bad)


LONG_MODULE_LINES = 400
"""A module past this many lines says why at the top of its docstring (docs/design.md, Layout)."""


def test_every_module_past_400_lines_says_why_at_its_top() -> None:
    unexplained = []
    for name, path in discover_modules(SRC, PACKAGE).items():
        source = path.read_text()
        lines = source.count("\n")
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if lines > LONG_MODULE_LINES and "Past 400 lines on purpose:" not in docstring:
            unexplained.append(f"{name} ({lines} lines)")
    assert not unexplained, f"past {LONG_MODULE_LINES} lines without a reason: {unexplained}"
