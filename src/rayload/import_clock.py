"""When this process began importing rayload, and when it had imported torch.

``rayload/__init__.py`` imports this module first, so :data:`IMPORT_START_NS` is the
moment ``import rayload`` began, and torch (rayload's heaviest dependency, imported by
``rayload.loading``) is imported here, timed on its own. A rank actor's
``rayload.spawn.import.*`` spans start from these (see
``rayload.actors.rank_actor.IMPORT_TIMES``).

While torch is imported, a :class:`_ChildImportTimer` sits first in ``sys.meta_path`` and
times each module torch's own ``__init__`` imports directly (its children one level down,
as ``python -X importtime`` shows them), from its loader's ``create_module`` (the dlopen
of an extension module) to the end of its ``exec_module``: :data:`TORCH_CHILD_IMPORTS`,
the children of ``rayload.spawn.import.torch``. The timer only wraps the loaders other
finders return; once torch is imported it is removed and every module's ``__loader__``
and ``__spec__.loader`` are the originals again, so nothing after sees it. A failure
inside the timer never fails the import: the timer stops timing, the import goes on as
it would without it, and :data:`TORCH_CHILD_IMPORTS` is empty.
"""

from __future__ import annotations

import time

IMPORT_START_NS = time.time_ns()

import importlib  # noqa: E402
import importlib.abc  # noqa: E402
import importlib.machinery  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

_logger = logging.getLogger(__name__)

MIN_CHILD_IMPORT_NS = 1_000_000
"""Children of torch's import shorter than this (1 ms) are not kept: they are many (56 of
torch 2.13's direct children, 26 under 1 ms) and together about 5% of the import. (At
5 ms the kept ones covered only 91-93% of it, and under load less than 90%.)"""


class _TimedLoader:
    """A loader that times the module it loads around the real ``loader``'s
    ``create_module`` .. ``exec_module`` and delegates everything else to it."""

    def __init__(self, loader: Any, timer: _ChildImportTimer) -> None:
        self._loader = loader
        self._timer = timer

    def __getattr__(self, name: str) -> Any:
        if name == "_loader":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        self._timer.load_started(spec.name)
        try:
            return self._loader.create_module(spec)
        except BaseException:
            self._timer.load_ended(spec.name, failed=True)
            raise

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            self._timer.load_ended(module.__name__)


class _ChildImportTimer(importlib.abc.MetaPathFinder):
    """Finds each module's spec through the finders after it and wraps its loader in a
        :class:`_TimedLoader`; records ``(module, start_ns, end_ns)`` of the loads that start
        at depth 1, while only ``root`` (torch) is executing: the depth counts every wrapped
    load, so a module a child imports is inside the child's time, not a record of its own."""

    def __init__(self, root: str) -> None:
        self._root = root
        self.records: list[tuple[str, int, int]] = []
        self.specs: list[importlib.machinery.ModuleSpec] = []
        self.broken = False
        self._open: list[tuple[str, int]] = []

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if self.broken:
            return None
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return self._wrapped(spec)
            return None
        except Exception:
            self._fail("finding %s", fullname)
            return None

    def _wrapped(self, spec: importlib.machinery.ModuleSpec) -> importlib.machinery.ModuleSpec:
        loader = spec.loader
        if (
            loader is None
            or spec.origin in (None, "built-in", "frozen")
            or isinstance(loader, (type, importlib.machinery.NamespaceLoader))
        ):
            return spec
        if not (hasattr(loader, "create_module") and hasattr(loader, "exec_module")):
            return spec
        spec.loader = _TimedLoader(loader, self)  # type: ignore[assignment]
        self.specs.append(spec)
        return spec

    def load_started(self, name: str) -> None:
        if self.broken:
            return
        try:
            self._open.append((name, time.time_ns()))
        except Exception:
            self._fail("timing %s", name)

    def load_ended(self, name: str, *, failed: bool = False) -> None:
        if self.broken:
            return
        end_ns = time.time_ns()
        try:
            opened, start_ns = self._open.pop()
            if opened != name:
                raise RuntimeError(f"{name} ended while {opened} was loading")
        except Exception:
            self._fail("timing %s", name)
            return
        if not failed and len(self._open) == 1 and self._open[0][0] == self._root:
            self.records.append((name, start_ns, end_ns))

    def _fail(self, doing: str, *args: object) -> None:
        """Stop timing (a failing timer must not fail the import) and report nothing."""
        self.broken = True
        self.records.clear()
        _logger.debug("the child-import timer gave up " + doing, *args, exc_info=True)

    def restore(self) -> None:
        """Put every wrapped loader back, on its spec and on its module (through the
        module's ``__dict__``: some modules, torch's config modules, refuse ``setattr``).
        Every one is tried; any that fails makes the timer broken."""
        for spec in self.specs:
            try:
                wrapper = spec.loader
                if not isinstance(wrapper, _TimedLoader):
                    continue
                spec.loader = wrapper._loader
                module = sys.modules.get(spec.name)
                namespace = {} if module is None else vars(module)
                if isinstance(namespace.get("__loader__"), _TimedLoader):
                    namespace["__loader__"] = wrapper._loader
            except Exception:
                self._fail("restoring the loader of %s", spec.name)
        self.specs.clear()


def _import_timed(package: str) -> tuple[tuple[str, int, int], ...]:
    """Import ``package`` with its direct children timed; the kept ``(module, start_ns,
    end_ns)`` in load order, or none when it was already imported or timing failed."""
    if package in sys.modules:
        return ()
    timer: _ChildImportTimer | None = None
    try:
        timer = _ChildImportTimer(package)
        sys.meta_path.insert(0, timer)
    except Exception:
        _logger.debug("the child-import timer was not installed", exc_info=True)
        timer = None
    try:
        importlib.import_module(package)
    finally:
        if timer is not None:
            try:
                if timer in sys.meta_path:
                    sys.meta_path.remove(timer)
                timer.restore()
            except Exception:
                timer._fail("restoring the loaders")
    if timer is None or timer.broken:
        return ()
    return tuple(r for r in timer.records if r[2] - r[1] >= MIN_CHILD_IMPORT_NS)


TORCH_CHILD_IMPORTS = _import_timed("torch")  # imported here, between the two stamps
"""``(module, start_ns, end_ns)`` of the modules torch's ``__init__`` imported directly
that took at least :data:`MIN_CHILD_IMPORT_NS`, on this process's wall clock, in order
(empty when torch was imported before rayload or the timer failed)."""

TORCH_IMPORTED_NS = time.time_ns()
