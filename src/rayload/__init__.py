"""rayload: load tensor-parallel model weights onto a Ray cluster fast, and show where
start-up time goes.

::

    import rayload
    with rayload.load("path/to/model", tp_size=4) as result:
        print(result.startup_metrics, result.trace_id)

``load`` and ``LoadResult`` are imported on first use, so ``import rayload`` (and the CLI's
Ray-free commands) do not pay for importing Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rayload import import_clock  # noqa: F401  (first: it times this import and torch's)
from rayload.errors import RayloadError
from rayload.loading.methods import LoadMethod

if TYPE_CHECKING:
    from rayload.api import LoadResult, load

__all__ = ["LoadMethod", "LoadResult", "RayloadError", "load"]
__version__ = "0.1.0"

_LAZY = {"load", "LoadResult"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from rayload import api

        return getattr(api, name)
    raise AttributeError(f"module 'rayload' has no attribute {name!r}")
