"""What this process can do: CUDA, GPUDirect Storage, fastsafetensors, pinned memory.

The probe is lazy and never raises: importing this module touches nothing, and
:func:`probe_environment` turns every missing or broken capability into a ``False``/``None``
field (with the reason where one is useful) so the resolver can choose and explain a
fallback instead of crashing.

Inside a Ray actor the GPU is the actor's *local* device, index 0 of the set
``CUDA_VISIBLE_DEVICES`` makes visible; the probe never looks at ``cuda:{rank}``.
"""

from __future__ import annotations

import ctypes
import glob
import inspect
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_CUFILE_SONAMES = ("libcufile.so.0", "libcufile.so")
_NVIDIA_FS_GLOB = "/dev/nvidia-fs*"
_GDR_COPIER_TYPE = "gdr"


@dataclass(frozen=True)
class EnvProbe:
    """Capabilities of the current process, as far as loading weights is concerned.

    Invariant: every field has a value even when the capability is missing; the
    ``*_error`` fields say why an import or a check failed (None when it did not).
    """

    cuda_available: bool = False
    """``torch.cuda.is_available()``."""
    device_count: int = 0
    """Visible CUDA devices."""
    device_index: int = 0
    """The local device the probe looked at (0 of the visible set unless asked)."""
    device_name: str | None = None
    device_total_memory: int | None = None
    """Bytes of memory of the local device."""
    cufile_loadable: bool = False
    """``libcufile`` can be ``dlopen``-ed."""
    nvidia_fs_present: bool = False
    """A ``/dev/nvidia-fs*`` device node exists. Without it fastsafetensors' GDS copier
    silently uses its CPU bounce-buffer copier instead."""
    fastsafetensors_version: str | None = None
    """None when fastsafetensors cannot be imported."""
    fastsafetensors_error: str | None = None
    fastsafetensors_copier_type_arg: bool = False
    """``SafeTensorsFileLoader`` takes a ``copier_type`` argument by name."""
    fastsafetensors_copier_types: tuple[str, ...] = ()
    """Copier types registered in fastsafetensors' copier registry (e.g. ``gds``,
    ``nogds``); released versions have no ``gdr``."""
    pinned_memory: bool = False
    """Page-locked host memory can be allocated (needs CUDA)."""

    @property
    def gds_available(self) -> bool:
        """cuFile can drive GPUDirect Storage: the library loads and the device node exists."""
        return self.cufile_loadable and self.nvidia_fs_present

    @property
    def fastsafetensors_installed(self) -> bool:
        return self.fastsafetensors_version is not None

    @property
    def fastsafetensors_gdr_copier(self) -> bool:
        """The installed fastsafetensors can be asked for a ``gdr`` copier by name."""
        return (
            self.fastsafetensors_copier_type_arg
            and _GDR_COPIER_TYPE in self.fastsafetensors_copier_types
        )

    @property
    def gds_missing_reason(self) -> str | None:
        """Why GDS is unavailable, or None when it is available."""
        missing = []
        if not self.cufile_loadable:
            missing.append("libcufile cannot be loaded")
        if not self.nvidia_fs_present:
            missing.append(f"no {_NVIDIA_FS_GLOB} device node (nvidia-fs driver)")
        return "; ".join(missing) or None


FASTSAFETENSORS_NOT_PROBED = "not probed: the requested load method does not use it"


def probe_environment(device_index: int | None = None, *, fastsafetensors: bool = True) -> EnvProbe:
    """Probe the current process. ``device_index`` is an index into the *visible* CUDA
    devices (default 0, the actor's local GPU). ``fastsafetensors=False`` skips importing
    fastsafetensors (60 ms of a fresh process's first load on an H200 host) for methods
    that never use it; its fields then say it was not probed. Never raises."""
    index = 0 if device_index is None else device_index
    cuda = _probe_cuda(index)
    fst = (
        _probe_fastsafetensors()
        if fastsafetensors
        else {"fastsafetensors_error": FASTSAFETENSORS_NOT_PROBED}
    )
    return EnvProbe(
        **cuda,
        device_index=index,
        cufile_loadable=_cufile_loadable(),
        nvidia_fs_present=bool(glob.glob(_NVIDIA_FS_GLOB)),
        **fst,
    )


def _probe_cuda(index: int) -> dict[str, Any]:
    import torch

    try:
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    except RuntimeError as exc:  # a broken driver install raises instead of returning False
        log.debug("CUDA probe failed: %s", exc)
        return {"cuda_available": False}
    if not available or index >= count:
        return {"cuda_available": available, "device_count": count}
    props = torch.cuda.get_device_properties(index)
    return {
        "cuda_available": True,
        "device_count": count,
        "device_name": props.name,
        "device_total_memory": int(props.total_memory),
        "pinned_memory": _pinned_memory_usable(),
    }


def _pinned_memory_usable() -> bool:
    import torch

    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        log.debug("pinned memory unavailable: %s", exc)
        return False
    return True


def _cufile_loadable() -> bool:
    for soname in _CUFILE_SONAMES:
        try:
            ctypes.CDLL(soname)
        except OSError:
            continue
        return True
    return False


def _probe_fastsafetensors() -> dict[str, Any]:
    try:
        import fastsafetensors
        from fastsafetensors import SafeTensorsFileLoader
    except (ImportError, OSError) as exc:  # OSError: its C extension failed to load
        return {"fastsafetensors_error": f"{type(exc).__name__}: {exc}"}
    params = inspect.signature(SafeTensorsFileLoader.__init__).parameters
    return {
        "fastsafetensors_version": str(getattr(fastsafetensors, "__version__", "unknown")),
        "fastsafetensors_copier_type_arg": "copier_type" in params,
        "fastsafetensors_copier_types": _registered_copier_types(),
    }


def _registered_copier_types() -> tuple[str, ...]:
    """Names in fastsafetensors' copier registry; () for versions without a registry."""
    try:
        from fastsafetensors.copier import registry
    except ImportError:
        return ()
    table = getattr(registry, "_copier_registry", None)
    return tuple(sorted(table)) if isinstance(table, dict) else ()


def read_chars() -> int | None:
    """Bytes this process has read through ``read()``-family calls so far (``rchar`` of
    ``/proc/self/io``: files, pipes and sockets alike, page cache or not); None where the
    kernel does not say (not Linux)."""
    try:
        with open("/proc/self/io", encoding="ascii") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None
