"""A Ray actor that pays exactly what Ray must for a rank: its module imports torch and
rayload when the worker loads the class, and the actor does nothing else.

The class is pickled by reference (this module is importable in every worker), so a worker
that runs it imports this module, hence torch and rayload, as a rank actor's worker imports
``rayload.actors.rank_actor``. :func:`preimport` is the same imports as a Ray
``worker_process_setup_hook`` (:mod:`rayload.benchmark.preimport`).
"""

from __future__ import annotations

import os
import sys
import time

import torch  # noqa: F401  (the import is the point)

import rayload  # noqa: F401


class ImportingActor:
    """Nothing but the imports above; :meth:`ready` says where and when it is."""

    def ready(self) -> tuple[int, bool, int]:
        """``(pid, torch imported, time.time_ns())``."""
        return os.getpid(), "torch" in sys.modules, time.time_ns()


def preimport() -> None:
    """A ``worker_process_setup_hook``: the rank actor's heavy imports, done when a Ray
    worker starts rather than when the rank actor's module is first loaded (torch came
    with this module)."""
    import rayload.actors.rank_actor  # noqa: F401
