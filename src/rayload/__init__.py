"""rayload: load tensor-parallel model weights onto a Ray cluster fast, and show where
start-up time goes.

::

    import rayload
    with rayload.load("path/to/model", tp_size=4) as result:
        print(result.startup_metrics, result.trace_id)

``rayload.load(rayload.LoadConfig(path=..., tp_size=4))`` does the same from one typed
config (:mod:`rayload.config`). ``load``, ``LoadResult`` and ``LoadConfig`` are imported on
first use, so ``import rayload`` (and the CLI's Ray-free commands) do not pay for importing
Ray or pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rayload import import_clock  # noqa: F401  (first: it times this import and torch's)
from rayload.errors import RayloadError
from rayload.loading.methods import LoadMethod

if TYPE_CHECKING:
    from rayload.api import LoadResult, load
    from rayload.config import LoadConfig

__all__ = ["LoadConfig", "LoadMethod", "LoadResult", "RayloadError", "load"]
__version__ = "0.1.0"

_LAZY = {"load": "rayload.api", "LoadResult": "rayload.api", "LoadConfig": "rayload.config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rayload' has no attribute {name!r}")
