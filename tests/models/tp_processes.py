"""``tp`` rank processes joined by a gloo process group, kept alive across checkpoints.

:class:`RankPool` spawns (start method "spawn", never fork) one process per rank; each
runs :func:`serve_rank`: ``init_process_group("gloo", tcp://127.0.0.1:PORT)`` once, then
for every job gets its shards, builds the reference model with
``rayload.models.build_model`` on meta, fills it and returns its logits. Workers never
import transformers (3 s each); importable as ``models.tp_processes`` in the children
because ``tests/`` is on sys.path.
"""

from __future__ import annotations

import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

_JOB_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Job:
    """One forward on every rank. ``source``: ``"convention"`` (the test's slicer) or
    ``"load_rank"`` (``rayload.loading.load_rank``, method scratch, on cpu)."""

    path: str
    input_ids: torch.Tensor
    source: str = "convention"


def _rank_logits(job: Job, rank: int, tp: int, group: Any) -> torch.Tensor:
    from models.shards import convention_shards, fill, read_config, stack_shards
    from rayload.loading import load_rank
    from rayload.loading.model import ModelContext
    from rayload.models import build_model

    path = Path(job.path)
    config = read_config(path)
    if job.source == "load_rank":
        tensors, _ = load_rank(path, rank, tp, method="scratch", device="cpu")
    else:
        tensors = convention_shards(path, rank, tp)
    model = build_model(ModelContext(rank, tp, "cpu", config, process_group=group))
    fill(model, stack_shards(tensors, type(model).stacked_params_mapping))
    with torch.no_grad():
        return model(job.input_ids)


def serve_rank(rank: int, tp: int, port: int, jobs: Any, results: Any) -> None:
    """A rank process: join the group, then answer jobs until it gets None."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        while (job := jobs.get()) is not None:
            try:
                results.put((rank, _rank_logits(job, rank, tp, dist.group.WORLD), None))
            except Exception:  # reported to the test, which fails with the traceback
                results.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankPool:
    """``tp`` spawned rank processes; :meth:`run` returns every rank's logits."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._jobs: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        port = _free_port()
        self._results = self._ctx.Queue()
        self._jobs = [self._ctx.Queue() for _ in range(self.tp)]
        self._procs = [
            self._ctx.Process(
                target=serve_rank,
                args=(rank, self.tp, port, self._jobs[rank], self._results),
                daemon=True,
            )
            for rank in range(self.tp)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, job: Job) -> list[torch.Tensor]:
        """Every rank's logits, in rank order; a rank's exception fails with its traceback
        (and restarts the pool on the next call: the other ranks may be stuck in a
        collective)."""
        if not self._procs:
            self._start()
        for queue in self._jobs:
            queue.put(job)
        logits: dict[int, torch.Tensor] = {}
        errors: list[str] = []
        try:
            for _ in range(self.tp):
                rank, out, error = self._results.get(timeout=_JOB_TIMEOUT_S)
                if error is not None:
                    errors.append(f"rank {rank}:\n{error}")
                    break
                logits[rank] = out.clone()
        except Exception as exc:
            self.close(force=True)
            raise RuntimeError(f"tp {self.tp}: no answer from every rank ({exc!r})") from exc
        if errors:
            self.close(force=True)
            raise RuntimeError("\n".join(errors))
        return [logits[rank] for rank in range(self.tp)]

    def close(self, *, force: bool = False) -> None:
        """Stop the processes: ask them to leave, or (``force``, when some may be stuck in
        a collective) terminate them."""
        for queue in self._jobs:
            queue.put(None)
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._procs, self._jobs, self._results = [], [], None
