"""A phase that times device work ends only after the device is synchronized (docs/design.md
"Spans"): checked at the moment each backend's ``rank.to_device`` phase ends, on a real GPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from rayload.loading import load_rank
from rayload.loading.rank import reload_rank
from rayload.loading.report import PhaseTimer
from rayload.loading.synthetic import write_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class _IdleAtExitTimer(PhaseTimer):
    """A real PhaseTimer that also notes, as each phase ends, whether the device still
    has queued work (``Stream.query()`` is False while a kernel or copy is pending)."""

    def __init__(self) -> None:
        super().__init__()
        self.idle_at_exit: dict[str, bool] = {}

    @contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        with super().phase(name, **attributes) as attrs:
            yield attrs
            self.idle_at_exit[name] = torch.cuda.current_stream(0).query()


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 1 GB: slicing and cloning it on the GPU outlasts the Python that queues it."""
    return write_checkpoint(tmp_path_factory.mktemp("large") / "ckpt", size_gb=1.0)


@pytest.mark.parametrize("method", ["fastsafetensors", "dummy", "scratch"])
def test_to_device_phase_ends_with_device_idle_on_cuda(large_checkpoint: Path, method: str) -> None:
    timer = _IdleAtExitTimer()
    load_rank(large_checkpoint, 0, 2, method, "cuda:0", timer=timer)
    assert timer.idle_at_exit["rank.to_device"] is True


def test_a_reload_onto_cuda_lands_after_the_work_already_queued_on_its_tensors(
    tmp_path: Path,
) -> None:
    """The staged copies run on a stream of their own: they must come after what the
    current stream had queued on the same tensors (a module's initialisation, a forward
    still running), not race it."""
    path = write_checkpoint(tmp_path / "ckpt", dtype="f32")
    tensors, _ = load_rank(path, 0, 2, "scratch", "cuda:0")
    want = {name: t.clone() for name, t in tensors.items()}
    torch.cuda._sleep(1_000_000_000)  # the current stream busy for about half a second,
    for t in tensors.values():  # then zeroing every tensor: queued, not yet run
        t.zero_()
    reload_rank(path, 0, 2, tensors, "scratch", "cuda:0")
    torch.cuda.synchronize()
    assert all(torch.equal(tensors[name], want[name]) for name in want)
