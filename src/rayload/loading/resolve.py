"""Which load method and device a rank uses: a pure function of the request, the
environment probe and the checkpoint layout.

The decision table is in docs/load-methods.md; every branch has a unit test with a
synthetic :class:`~rayload.loading.probe.EnvProbe`. :func:`resolve_method` only decides;
:func:`log_fallback` is the thin wrapper callers use so that a fallback is never silent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rayload.errors import ConfigError, MethodUnavailableError
from rayload.loading.checkpoint import Checkpoint, Layout
from rayload.loading.manifest import MANIFEST_NAME
from rayload.loading.methods import LoadMethod
from rayload.loading.plan_converted import check_converted_tp
from rayload.loading.probe import EnvProbe
from rayload.loading.storage import is_remote
from rayload.options import parse_method

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayoutInfo:
    """The facts about a checkpoint that resolution depends on.

    ``converted_tp_size`` is the tp size a ``converted`` checkpoint was written for (None
    for Hugging Face layouts).
    """

    layout: Layout
    root: str
    converted_tp_size: int | None = None

    def __post_init__(self) -> None:
        if (self.layout == "converted") != (self.converted_tp_size is not None):
            raise ValueError("converted_tp_size is set exactly for the converted layout")

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> LayoutInfo:
        return cls(checkpoint.layout, checkpoint.root, checkpoint.tp_size)


@dataclass(frozen=True)
class Resolution:
    """The method and device a rank will use.

    ``reason`` says why ``selected`` was chosen (for ``auto`` too); ``fallback_reason``
    is None exactly when ``selected`` is what was requested or what ``auto`` chose.
    ``storage`` is the method that reads the checkpoint's files: ``selected`` itself,
    except when ``selected`` is ``peer``, where it is the method ``auto`` would choose
    without a peer, which the peer backend falls back to when the peer fails (left out,
    it is ``selected``; a ``peer`` selection must name it).
    """

    requested: LoadMethod
    selected: LoadMethod
    device: str
    reason: str
    fallback_reason: str | None = None
    storage: LoadMethod | None = None

    def __post_init__(self) -> None:
        if self.storage is None and self.selected is not LoadMethod.PEER:
            object.__setattr__(self, "storage", self.selected)
        if self.storage in (None, LoadMethod.PEER, LoadMethod.AUTO):
            raise ValueError(f"storage must be a storage method, not {self.storage}")


def resolve_device(device: str | torch.device, probe: EnvProbe) -> str:
    """``auto``/``cpu``/``cuda``/``cuda:N`` to a concrete device string.

    ``auto`` is the local GPU (``cuda:0`` of the visible set) when CUDA is available, else
    ``cpu``. Asking for CUDA where there is none is a ConfigError, not a fallback: the
    caller asked for a device, not a method.
    """
    text = str(device)
    if text == "auto":
        return "cuda:0" if probe.cuda_available and probe.device_count > 0 else "cpu"
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"unknown device {text!r}; use auto, cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type != "cuda":
        raise ConfigError(f"unsupported device {text!r}; use auto, cpu, cuda or cuda:N")
    if not probe.cuda_available or probe.device_count == 0:
        raise ConfigError(
            f"device {text!r} requested but CUDA is not available in this process; "
            "use --device cpu or auto, or run on a node with a visible GPU"
        )
    index = parsed.index or 0
    if index >= probe.device_count:
        raise ConfigError(
            f"device {text!r} requested but only {probe.device_count} CUDA device(s) are "
            "visible; a rank uses its local device, cuda:0 of its visible set"
        )
    return f"cuda:{index}"


def resolve_method(
    requested: LoadMethod | str,
    probe: EnvProbe,
    layout_info: LayoutInfo,
    *,
    tp_size: int,
    device: str | torch.device,
    strict: bool,
    peer_available: bool = False,
    into: bool = False,
) -> Resolution:
    """Decide the method and device for a rank loading ``tp_size`` shards.

    ``peer_available`` says a rank of another replica holds this rank's shards (same
    checkpoint identity and plan): ``auto`` and ``peer`` then select ``peer``, with the
    storage method ``auto`` would otherwise choose as ``storage``; ``peer`` without one
    falls back to that storage method. Other requested methods ignore peers.
    ``into`` says the shards go into memory the caller gives (an engine's parameters,
    resident tensors): ``auto`` then picks a method that reads straight into it.

    Raises ConfigError for an unknown method or an unusable device, CheckpointError for a
    converted checkpoint written for another tp size, and MethodUnavailableError when
    ``strict`` and the requested method would fall back.
    """
    method = parse_method(requested)
    resolved_device = resolve_device(device, probe)
    check_converted_tp(layout_info.root, layout_info.converted_tp_size, tp_size)
    if method in (LoadMethod.AUTO, LoadMethod.PEER):
        storage, reason = _choose_auto(probe, layout_info, resolved_device, tp_size, into)
        if peer_available:
            why = (
                "a rank of another replica holds this rank's shards (same checkpoint "
                f"identity and plan): copy them from it, falling back to {storage.value} "
                f"({reason})"
            )
            return Resolution(method, LoadMethod.PEER, resolved_device, why, storage=storage)
        if method is LoadMethod.AUTO:
            return Resolution(method, storage, resolved_device, reason)
        return _fell_back(method, storage, resolved_device, [_NO_PEER], strict)

    selected: LoadMethod = method
    reasons: list[str] = []
    while (step := _fallback(selected, probe, layout_info, resolved_device, tp_size)) is not None:
        selected, why = step
        reasons.append(why)
    if not reasons:
        return Resolution(method, method, resolved_device, f"{method.value} was requested")
    return _fell_back(method, selected, resolved_device, reasons, strict)


def log_fallback(rank: int, requested: LoadMethod, used: LoadMethod, reason: str | None) -> None:
    """Log a WARNING when a rank does not run the method it was asked for."""
    if reason is not None:
        log.warning(
            "rank %d: load method %s falls back to %s: %s",
            rank,
            requested.value,
            used.value,
            reason,
        )


_NO_PEER = (
    "no replica holding this checkpoint (same identity and plan) was found; read from storage"
)


def _fell_back(
    method: LoadMethod, selected: LoadMethod, device: str, reasons: list[str], strict: bool
) -> Resolution:
    """The resolution of ``method`` falling back to ``selected`` for ``reasons``;
    MethodUnavailableError instead when ``strict``."""
    fallback_reason = "; ".join(reasons)
    if strict:
        raise MethodUnavailableError(
            f"load method {method.value!r} cannot run here: {fallback_reason} "
            f"(strict mode forbids falling back to {selected.value!r}; drop --strict-method "
            "or choose another --method)"
        )
    return Resolution(
        method,
        selected,
        device,
        f"{method.value} was requested but fell back to {selected.value}",
        fallback_reason,
    )


def _choose_auto(
    probe: EnvProbe, layout_info: LayoutInfo, device: str, tp_size: int, into: bool = False
) -> tuple[LoadMethod, str]:
    if layout_info.layout == "converted":
        return LoadMethod.CONVERTED, f"checkpoint was converted for tp_size={tp_size}"
    if is_remote(layout_info.root):
        return LoadMethod.SCRATCH, (
            "checkpoint is in object storage: rayload's reader, as concurrent ranged GETs"
        )
    if device == "cpu":
        return LoadMethod.SCRATCH, "device is cpu: rayload's shard-exact reader"
    if into:
        return LoadMethod.SCRATCH, (
            "loading into given device memory: rayload's reader writes straight into it "
            "through a pinned bounce window (fastsafetensors reads into buffers of its own)"
        )
    if probe.gds_available and probe.fastsafetensors_installed:
        return (
            LoadMethod.FASTSAFETENSORS_GDR,
            "CUDA device, GPUDirect Storage and fastsafetensors are available",
        )
    missing = probe.gds_missing_reason or "fastsafetensors is not installed"
    return LoadMethod.SCRATCH, f"no direct storage-to-GPU path ({missing}): rayload's reader"


def _fallback(
    method: LoadMethod, probe: EnvProbe, layout_info: LayoutInfo, device: str, tp_size: int
) -> tuple[LoadMethod, str] | None:
    """The method to try instead of ``method`` and why, or None when ``method`` can run
    here. Dummy always can, scratch on a Hugging Face layout and converted on a converted
    one too, so repeated fallback ends."""
    if method is LoadMethod.SCRATCH and layout_info.layout == "converted":
        return LoadMethod.CONVERTED, (
            "checkpoint is pre-sharded by `rayload convert`: its rank files are read by the "
            "converted method, which verifies the manifest checksums"
        )
    if method is LoadMethod.CONVERTED and layout_info.layout != "converted":
        return LoadMethod.SCRATCH, (
            f"no {MANIFEST_NAME} in {layout_info.root}; run `rayload convert "
            f"{layout_info.root} OUT --tp {tp_size}` and load OUT"
        )
    uses_fst = method in (LoadMethod.FASTSAFETENSORS, LoadMethod.FASTSAFETENSORS_GDR)
    if uses_fst and is_remote(layout_info.root):
        storage_method = (
            LoadMethod.CONVERTED if layout_info.layout == "converted" else LoadMethod.SCRATCH
        )
        return storage_method, (
            f"{method.value} reads local files only and the checkpoint is in object storage "
            f"({layout_info.root}): {storage_method.value} reads it with ranged GETs"
        )
    if uses_fst and not probe.fastsafetensors_installed:
        detail = f" ({probe.fastsafetensors_error})" if probe.fastsafetensors_error else ""
        return LoadMethod.SCRATCH, (
            f"fastsafetensors is not installed{detail}; pip install fastsafetensors"
        )
    if method is LoadMethod.FASTSAFETENSORS_GDR:
        if device == "cpu":
            return LoadMethod.FASTSAFETENSORS, (
                "GPUDirect Storage copies into GPU memory but the device is cpu"
            )
        if not probe.gds_available:
            return LoadMethod.FASTSAFETENSORS, (
                f"GPUDirect Storage is unavailable: {probe.gds_missing_reason}"
            )
    return None
