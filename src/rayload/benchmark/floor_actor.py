"""A Ray actor that pays exactly what Ray must for a rank: its module imports torch and
rayload when the worker loads the class, and the actor does nothing else.

The class is pickled by reference (this module is importable in every worker), so a worker
that runs it imports this module, hence torch and rayload, as a rank actor's worker imports
``rayload.actors.rank_actor``. It is a module of its own so that a worker loading
the class imports exactly torch and rayload, nothing more (:mod:`rayload.benchmark.startfloor`
times it).
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
