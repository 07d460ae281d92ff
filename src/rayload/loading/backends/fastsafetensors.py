"""``fastsafetensors`` and ``fastsafetensors_gdr``: one fastsafetensors loader per rank.

Both run one ``SafeTensorsFileLoader(SingleGroup(), device, ...)`` over the files holding
this rank's tensors, filtered to those tensors, then slice the rank's shard out of each
full tensor and clone it so nothing keeps fastsafetensors' file buffer alive. The only
difference is the copier asked for: the CPU bounce buffer (``nogds=True``) or cuFile GDS
(``nogds=False``; ``copier_type="gdr"`` only where the installed version takes it).

fastsafetensors falls back from GDS to its bounce-buffer copier without raising (missing
``/dev/nvidia-fs*``, no libcufile, a file-handle setup failure). The GDR backend detects
that after the fact and reports ``effective=fastsafetensors`` with the reason; see
:meth:`FastsafetensorsGdrBackend._effective`.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from rayload.errors import CheckpointError, RayloadError
from rayload.loading.backends.base import Backend, BackendResult, register, synchronize
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan, TensorShard
from rayload.loading.reader.reads import truncated_error, unreadable_error
from rayload.loading.report import READ, TO_DEVICE, PhaseTimer

log = logging.getLogger(__name__)

_GDS_COPIERS = frozenset({"GdsFileCopier", "FgdsFileCopier"})
_GDS_LOGGER = "fastsafetensors.copier.gds"


class _FastsafetensorsBase(Backend):
    """The shared loader life cycle; subclasses set the copier and judge what ran."""

    nogds: ClassVar[bool]

    def _loader_options(self) -> dict[str, Any]:
        return {"nogds": self.nogds}

    def _effective(self, copier: str | None, notes: list[str]) -> tuple[LoadMethod, str | None]:
        """What really ran, given the copier class name fastsafetensors reports (None for
        versions without ``copier_class``) and the warnings it emitted."""
        return self.method, None

    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        try:
            return self._run_loader(plan, device, timer)
        except RayloadError:
            raise
        except Exception as exc:
            # fastsafetensors says "Exception: MetadataIncompleteBuffer, src=..." or a bare
            # FileNotFoundError: if a file is at fault, say which, and which tensor, as
            # rayload's own reader does; anything else (device memory, ...) stays as it is.
            if (problem := _file_problem(plan)) is None:
                raise
            raise problem from exc

    def _run_loader(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        wanted = {s.name for s in plan.shards}
        with _fastsafetensors_notes() as notes:
            loader = SafeTensorsFileLoader(SingleGroup(), str(device), **self._loader_options())
            try:
                loader.add_filenames({0: list(plan.files)})
                loader.set_tensor_filter(wanted.__contains__)
                full_bytes = sum(_frame_bytes(loader, name) for name in wanted)
                with timer.phase(READ, bytes=plan.nbytes, bytes_read=full_bytes):
                    buffers = loader.copy_files_to_device()
                try:
                    with timer.phase(TO_DEVICE, device=str(device)):
                        tensors = {
                            s.name: _take_shard(buffers.get_tensor(s.name), s) for s in plan.shards
                        }
                        synchronize(device)  # the clones run asynchronously on CUDA
                finally:
                    buffers.close()
                copier = getattr(loader, "copier_class", None)
            finally:
                loader.close()
        effective, reason = self._effective(copier.__name__ if copier else None, notes)
        return BackendResult(tensors, full_bytes, effective, reason)


@register(LoadMethod.FASTSAFETENSORS)
class FastsafetensorsBackend(_FastsafetensorsBase):
    """fastsafetensors with its bounce-buffer copier (``nogds=True``)."""

    nogds = True


@register(LoadMethod.FASTSAFETENSORS_GDR)
class FastsafetensorsGdrBackend(_FastsafetensorsBase):
    """fastsafetensors with cuFile GPUDirect Storage (``nogds=False``)."""

    nogds = False

    def _loader_options(self) -> dict[str, Any]:
        if self.probe.fastsafetensors_gdr_copier:
            return {"copier_type": "gdr"}
        return super()._loader_options()

    def _effective(self, copier: str | None, notes: list[str]) -> tuple[LoadMethod, str | None]:
        """GDS ran only if fastsafetensors built a GDS copier *and* no file fell back.

        fastsafetensors >= 0.5 names the copier it built in ``loader.copier_class``; older
        versions do not, so the probe stands in (GDS needs libcufile and /dev/nvidia-fs*).
        A GDS copier can still hand a file to its nogds fallback when the cuFile handle
        cannot be set up; fastsafetensors logs that once per process, which is caught here.
        """
        said = "; ".join(dict.fromkeys(notes))
        detail = f" ({said})" if said else ""
        if copier is not None and copier not in _GDS_COPIERS:
            return LoadMethod.FASTSAFETENSORS, (
                f"fastsafetensors used its {copier} instead of GPUDirect Storage{detail}"
            )
        if copier is None and not self.probe.gds_available:
            return LoadMethod.FASTSAFETENSORS, (
                "fastsafetensors cannot use GPUDirect Storage here "
                f"({self.probe.gds_missing_reason}) and copies through host memory"
            )
        if any("falling back to the nogds copier" in note for note in notes):
            return LoadMethod.FASTSAFETENSORS, (
                f"fastsafetensors' GDS copier fell back to its nogds copier{detail}"
            )
        return self.method, None


@contextmanager
def _fastsafetensors_notes() -> Iterator[list[str]]:
    """Collect what fastsafetensors says about its copier: Python warnings raised while
    the loader is built and the GDS copier's log records while files are copied."""
    notes: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    handler = _Collect(logging.WARNING)
    gds_log = logging.getLogger(_GDS_LOGGER)
    gds_log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield notes
    finally:
        gds_log.removeHandler(handler)
    for warning in caught:
        notes.append(str(warning.message))
        log.debug("fastsafetensors: %s", warning.message)


def _file_problem(plan: RankPlan) -> CheckpointError | None:
    """What is wrong with ``plan``'s files now, if anything: one missing or unreadable,
    or shorter than a planned tensor's bytes (it changed since it was planned)."""
    for path in plan.files:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
        except OSError as exc:
            return unreadable_error(path, exc)
        for shard in plan.shards:
            last = shard.ranges[-1] if shard.ranges else None  # ranges run in file order
            if last is not None and last.file == path and last.offset + last.length > size:
                return truncated_error(path, size, shard.name)
    return None


def _frame_bytes(loader: Any, name: str) -> int:
    """Bytes of the whole tensor ``name`` in its file (what fastsafetensors reads for it)."""
    start, end = loader.frames[name].data_offsets
    return int(end - start)


def _take_shard(full: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    """This rank's pieces of ``full`` (concatenated, for a fused tensor) as a tensor of its
    own.

    A tensor already of the shard's shape (replicated, or a converted checkpoint's
    pre-sharded tensor) is taken whole. The clone is contiguous and owns its memory, so
    the loader's file buffer can be freed.
    """
    shape = tuple(full.shape)
    if shape != shard.shape:
        if shard.split is None or shape != shard.full_shape:
            raise CheckpointError(
                f"{os.path.basename(shard.ranges[0].file) if shard.ranges else '?'}: tensor "
                f"{shard.name!r} has shape {list(shape)} in the file but the plan expects "
                f"{list(shard.full_shape)}; re-plan the checkpoint",
                tensor=shard.name,
            )
        pieces = [full.narrow(shard.split, start, n) for start, n in shard.pieces]
        if len(pieces) > 1:
            return torch.cat(pieces, dim=shard.split)
        # A clone, not .contiguous(): a split-0 piece of a contiguous tensor is contiguous
        # already, a view that would keep the whole file buffer alive.
        return pieces[0].clone(memory_format=torch.contiguous_format)
    return full.clone(memory_format=torch.contiguous_format)
