"""``tp`` rank processes joined by a gloo process group, kept alive across checkpoints.

:class:`RankPool` spawns (start method "spawn", never fork) one process per rank; each
runs :func:`serve_rank`: ``init_process_group("gloo", tcp://127.0.0.1:PORT)`` once, then
for every checkpoint does what a rayload rank does with ``model=build_model``:
``load_rank`` (method scratch, cpu; tensor or expert parallel),
``rayload.models.build_model`` on meta, ``fill_model``, and returns the forward's logits.
Workers never import transformers (3 s each); this module is importable in the children
as ``models.tp_processes`` because ``tests/`` is on sys.path.
"""

from __future__ import annotations

import socket
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

_JOB_TIMEOUT_S = 120.0


def rank_logits(
    path: Path,
    input_ids: torch.Tensor,
    rank: int,
    tp: int,
    group: Any = None,
    *,
    expert_parallel: bool = False,
) -> torch.Tensor:
    """Rank ``rank`` of ``tp``'s logits for the checkpoint at ``path``: its shards as
    rayload loads them, in the reference model, filled by rayload's filler."""
    from rayload.loading import load_rank, open_checkpoint
    from rayload.loading.fill import fill_model
    from rayload.loading.model import ModelContext
    from rayload.models import build_model

    config = dict(open_checkpoint(path).config or {})
    tensors, _ = load_rank(
        path, rank, tp, method="scratch", device="cpu", expert_parallel=expert_parallel
    )
    context = ModelContext(
        rank, tp, "cpu", config, process_group=group, expert_parallel=expert_parallel
    )
    model = build_model(context)
    fill_model(model, tensors, rank=rank)
    with torch.no_grad():
        return model(input_ids)


def serve_rank(rank: int, tp: int, port: int, jobs: Any, results: Any) -> None:
    """A rank process: join the group, then answer ``(path, input_ids, expert_parallel)``
    jobs until None."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        while (job := jobs.get()) is not None:
            path, input_ids, expert_parallel = job
            try:
                logits = rank_logits(
                    Path(path),
                    input_ids,
                    rank,
                    tp,
                    dist.group.WORLD,
                    expert_parallel=expert_parallel,
                )
                results.put((rank, logits, None))
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

    def run(
        self, path: Path, input_ids: torch.Tensor, *, expert_parallel: bool = False
    ) -> list[torch.Tensor]:
        """Every rank's logits, in rank order; a rank's exception fails with its traceback
        (and restarts the pool on the next call: the other ranks may be stuck in a
        collective)."""
        if not self._procs:
            self._start()
        for queue in self._jobs:
            queue.put((str(path), input_ids, expert_parallel))
        logits: dict[int, torch.Tensor] = {}
        try:
            for _ in range(self.tp):
                rank, out, error = self._results.get(timeout=_JOB_TIMEOUT_S)
                if error is not None:
                    raise RuntimeError(f"rank {rank} of tp {self.tp} failed:\n{error}")
                logits[rank] = out.clone()
        except Exception:
            self.close(force=True)
            raise
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
