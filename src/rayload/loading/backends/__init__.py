"""Load-method backends: one class per :class:`~rayload.loading.methods.LoadMethod`,
looked up in :data:`BACKENDS`. Importing this package registers all of them; optional
machinery (fastsafetensors, CUDA) is imported only when a backend runs."""

from __future__ import annotations

from rayload.loading.backends import converted, dummy, fastsafetensors, peer, scratch
from rayload.loading.backends.base import BACKENDS, Backend, BackendResult, register

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendResult",
    "converted",
    "dummy",
    "fastsafetensors",
    "peer",
    "register",
    "scratch",
]
