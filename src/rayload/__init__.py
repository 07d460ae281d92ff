"""rayload: load tensor-parallel model weights onto a Ray cluster fast, and show where
start-up time goes."""

from __future__ import annotations

from rayload.errors import RayloadError
from rayload.loading.methods import LoadMethod

__all__ = ["LoadMethod", "RayloadError"]
__version__ = "0.1.0"
