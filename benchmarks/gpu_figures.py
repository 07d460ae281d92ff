"""GPU figures that the rank-process harness does not produce (run by benchmarks/gpu.sh).

    python benchmarks/gpu_figures.py probe          # what rayload's probe sees (GDS, cuFile)
    python benchmarks/gpu_figures.py h2d [GiB]      # host-to-device bandwidth, pinned/pageable
    python benchmarks/gpu_figures.py sweep CKPT     # scratch onto cuda:0, reader settings
    python benchmarks/gpu_figures.py first CKPT [THREADS...]  # a fresh process's loads
    python benchmarks/gpu_figures.py register CKPT  # experiment: DMA out of the page cache
    python benchmarks/gpu_figures.py hybrid CKPT    # experiment: that DMA and scratch at once
    python benchmarks/gpu_figures.py summary JSON   # GB/s per GPU and effective methods

Every sub-command prints lines of ``key: value`` and exits non-zero on a failed check.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

TARGET_GBPS = 35.0


def probe() -> int:
    import torch

    from rayload.loading import probe as probe_module
    from rayload.loading.probe import probe_environment

    torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
    # What each part of the probe costs the first time in a process (CUDA already up):
    # every rank's first load pays them in rank.resolve.
    for part in ("_probe_fastsafetensors", "_cufile_loadable", "_pinned_memory_usable"):
        t0 = time.perf_counter()
        getattr(probe_module, part)()
        print(f"probe.first_call_ms.{part}: {(time.perf_counter() - t0) * 1e3:.1f}")
    env = probe_environment()
    print(f"torch: {torch.__version__} (CUDA {torch.version.cuda})")
    for key, value in sorted(vars(env).items()):
        print(f"probe.{key}: {value}")
    print(f"probe.gds_available: {env.gds_available}")
    print(f"probe.gds_missing_reason: {env.gds_missing_reason}")
    if not env.cuda_available:
        print("FAIL: torch sees no CUDA device", file=sys.stderr)
        return 1
    return 0


def h2d(gib: float) -> int:
    """Copy ``gib`` GiB host-to-device from a pinned and from a pageable buffer, 5 times
    each after one warm-up, timed with CUDA events; print the median GB/s (10^9 B/s)."""
    import torch

    nbytes = int(gib * (1 << 30))
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for label, pinned in (("pinned", True), ("pageable", False)):
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        rates = []
        for i in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=pinned)
            end.record()
            end.synchronize()
            if i:
                rates.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        print(
            f"h2d.{label}_gbps: {statistics.median(rates):.1f} (runs: "
            f"{', '.join(f'{r:.1f}' for r in rates)})"
        )
        del src
    return 0


def sweep(checkpoint: str, repeat: int = 2) -> int:
    """scratch, TP=1, onto the local GPU from the page cache with several reader settings
    (threads x chunk size, staging = threads + 2 pinned chunks): the best of ``repeat``
    loads as GB/s of ``load_rank`` end to end (headers, plan, pinned allocation, reads,
    copies, ``rank.sync``), and that load's phases. In-process, one load at a time."""
    import torch

    from rayload.loading import load_rank
    from rayload.loading.reader import ReaderOptions

    _warm_files(checkpoint)
    torch.zeros(1, device="cuda")
    print(f"sweep.cpus: {os.cpu_count()}")
    for threads in (4, 8, 12, 16):
        for chunk_mib in (8, 32, 64):
            options = ReaderOptions(threads=threads, chunk_bytes=chunk_mib << 20)
            best: tuple[float, Any] | None = None
            for _ in range(repeat):
                t0 = time.perf_counter()
                tensors, report = load_rank(
                    checkpoint, 0, 1, "scratch", "cuda", reader_options=options, strict=True
                )
                seconds = time.perf_counter() - t0
                nbytes = report.bytes_read
                del tensors
                if best is None or seconds < best[0]:
                    best = (seconds, report)
            assert best is not None
            seconds, report = best
            phases = ", ".join(f"{p.name} {p.seconds * 1e3:.1f} ms" for p in report.phases)
            print(
                f"sweep.scratch.threads{threads}.chunk{chunk_mib}MiB: "
                f"{nbytes / seconds / 1e9:.1f} GB/s ({nbytes / 1e9:.2f} GB in "
                f"{seconds:.3f} s; {phases})"
            )
            torch.cuda.empty_cache()
    return 0


def first(checkpoint: str, threads: list[int]) -> int:
    """What a fresh process pays: for each reader thread count, a new Python process
    initializes CUDA, then loads the checkpoint with scratch onto cuda:0 three times in a
    row (8 MiB chunks), printing each load's GB/s and phases. The first load is the one a
    serving engine's start-up sees; the later ones show what the first paid for once
    (probe, device memory, pinned staging)."""
    import subprocess

    _warm_files(checkpoint)
    script = """
import sys, time, torch
from rayload.loading import load_rank
from rayload.loading.reader import ReaderOptions
t0 = time.perf_counter(); torch.zeros(1, device="cuda")
print(f"first.threads{sys.argv[2]}.cuda_init: {time.perf_counter() - t0:.3f} s")
options = ReaderOptions(threads=int(sys.argv[2]), chunk_bytes=8 << 20)
for i in range(3):
    t0 = time.perf_counter()
    tensors, report = load_rank(sys.argv[1], 0, 1, "scratch", "cuda", reader_options=options)
    seconds = time.perf_counter() - t0
    phases = ", ".join(f"{p.name} {p.seconds * 1e3:.0f} ms" for p in report.phases)
    print(f"first.threads{sys.argv[2]}.load{i}: {report.bytes_read / seconds / 1e9:.1f} GB/s "
          f"({seconds:.3f} s; {phases})", flush=True)
    del tensors
"""
    failed = 0
    for n in threads:
        failed |= subprocess.run([sys.executable, "-c", script, checkpoint, str(n)]).returncode
    return failed


def _warm_files(checkpoint: str) -> list[str]:
    """The checkpoint's safetensors files, read once so they are in the page cache."""
    files = sorted(
        os.path.join(checkpoint, f) for f in os.listdir(checkpoint) if f.endswith(".safetensors")
    )
    for path in files:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    return files


class _Mapped:
    """The files mapped read-only (MAP_SHARED) and seen as uint8 CPU tensors, with
    ``cudaHostRegister`` / ``cudaHostUnregister`` on any piece of them."""

    READONLY = 8  # cudaHostRegisterReadOnly

    def __init__(self, files: list[str]) -> None:
        import ctypes

        import numpy as np
        import torch

        self._cudart = torch.cuda.cudart()
        self._libc = libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (
            (ctypes.c_void_p, ctypes.c_size_t) + (ctypes.c_int,) * 3 + (ctypes.c_long,)
        )
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        self.maps: list[tuple[int, int]] = []
        for path in files:
            size = os.path.getsize(path)
            fd = os.open(path, os.O_RDONLY)
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            os.close(fd)
            if addr in (None, ctypes.c_void_p(-1).value):
                self.close()
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            self.maps.append((addr, size))
        self.host = [
            torch.from_numpy(np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(addr)))
            for addr, size in self.maps
        ]

    def register(self, addr: int, size: int, flags: int = READONLY) -> int:
        return int(self._cudart.cudaHostRegister(addr, size, flags))

    def unregister(self, addr: int) -> int:
        return int(self._cudart.cudaHostUnregister(addr))

    def pieces(self, step: int) -> list[tuple[int, int, int]]:
        """``(file index, offset, length)`` of every ``step``-byte piece of every file."""
        return [
            (i, off, min(step, size - off))
            for i, (_, size) in enumerate(self.maps)
            for off in range(0, size, step)
        ]

    def pipeline(self, dst: list[Any], threads: int, step: int, flags: int = READONLY) -> list[int]:
        """Each of ``threads`` threads registers a piece, copies it into ``dst`` on its
        own stream, waits, unregisters; returns the CUDA error codes seen (0: none)."""
        import threading
        from concurrent.futures import ThreadPoolExecutor

        import torch

        local = threading.local()

        def piece(i: int, off: int, n: int) -> int:
            stream = getattr(local, "stream", None) or torch.cuda.Stream()
            local.stream = stream
            addr = self.maps[i][0] + off
            if err := self.register(addr, n, flags):
                return err
            with torch.cuda.stream(stream):
                dst[i][off : off + n].copy_(self.host[i][off : off + n], non_blocking=True)
            stream.synchronize()
            return self.unregister(addr)

        with ThreadPoolExecutor(threads) as pool:
            return sorted(set(pool.map(lambda job: piece(*job), self.pieces(step))))

    def close(self) -> None:
        for addr, size in self.maps:
            self._libc.munmap(addr, size)
        self.maps = []


def register(checkpoint: str) -> int:
    """Experiment, not a rayload method: copy the page cache to the GPU with no pinned
    bounce buffer. Each file is mapped read-only (MAP_SHARED); pieces of the mapping are
    page-locked with ``cudaHostRegister(..., cudaHostRegisterReadOnly)`` and copied with
    one DMA each. Prints registration and copy rates separately (whole files, one
    thread), then a pipeline where each of N threads registers a piece, copies it on its
    own stream, waits, unregisters."""
    import torch

    files = _warm_files(checkpoint)
    mapped = _Mapped(files)
    total = sum(size for _, size in mapped.maps)
    dst = [torch.empty(size, dtype=torch.uint8, device="cuda") for _, size in mapped.maps]
    torch.cuda.synchronize()

    # 1. Whole files, one thread: what registration and the copy each cost.
    for flags, label in ((_Mapped.READONLY, "readonly"), (0, "default")):
        t0 = time.perf_counter()
        errors = [mapped.register(addr, size, flags) for addr, size in mapped.maps]
        t_reg = time.perf_counter() - t0
        if any(errors):
            print(f"register.{label}: cudaHostRegister failed, errors {sorted(set(errors))}")
            for (addr, _), err in zip(mapped.maps, errors, strict=True):
                if not err:
                    mapped.unregister(addr)
            continue
        print(f"register.{label}.pinned_memory: {mapped.host[0].is_pinned()}")
        t0 = time.perf_counter()
        for d, h in zip(dst, mapped.host, strict=True):
            d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        t_copy = time.perf_counter() - t0
        ok = all(
            torch.equal(d[:4096].cpu(), h[:4096]) for d, h in zip(dst, mapped.host, strict=True)
        )
        t0 = time.perf_counter()
        errors = [mapped.unregister(addr) for addr, _ in mapped.maps]
        t_unreg = time.perf_counter() - t0
        print(
            f"register.{label}.whole_files: register {total / t_reg / 1e9:.1f} GB/s "
            f"({t_reg:.3f} s), copy {total / t_copy / 1e9:.1f} GB/s ({t_copy:.3f} s), "
            f"unregister {t_unreg:.3f} s, end to end {total / (t_reg + t_copy + t_unreg) / 1e9:.1f}"
            f" GB/s, bytes agree: {ok}, unregister errors: {sorted(set(errors))}"
        )
        break
    else:
        mapped.close()
        return 0

    # 2. The pipeline: pieces registered, copied and released by N threads at once.
    for threads in (4, 8, 16):
        for piece_mib in (16, 64):
            t0 = time.perf_counter()
            errors = mapped.pipeline(dst, threads, piece_mib << 20, flags)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            print(
                f"register.pipeline.threads{threads}.piece{piece_mib}MiB: "
                f"{total / seconds / 1e9:.1f} GB/s ({seconds:.3f} s), errors {errors}"
            )
    mapped.close()
    return 0


def hybrid(checkpoint: str, repeat: int = 2) -> int:
    """Experiment: both ways at once. The files are split by bytes between registered
    page-cache DMA (``_Mapped.pipeline``, 4 threads, 64 MiB pieces: its best setting on
    the H200 VM) and rayload's staged reader
    (``read_segments`` onto cuda:0, 8 MiB chunks, pinned staging already allocated by a
    warm-up), which run concurrently. On the H200 VM each alone topped out at about 20
    and 28 GB/s; if together they pass 35 GB/s, the copy out of the page cache (CPU) was
    the bound and a loader using both is worth building; if not, memory bandwidth is.
    Prints the best of ``repeat`` per setting and whether every byte arrived intact."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from rayload.loading.reader import ReaderOptions
    from rayload.loading.reader.readplan import Segment
    from rayload.loading.reader.reads import read_segments

    files = _warm_files(checkpoint)
    total = sum(os.path.getsize(f) for f in files)
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)
    for share in (0.3, 0.45):
        dma: list[str] = []
        staged: list[str] = []
        for path in sorted(files, key=os.path.getsize, reverse=True):
            dma_bytes = sum(os.path.getsize(f) for f in dma)
            (dma if dma_bytes < share * total else staged).append(path)
        mapped = _Mapped(dma)
        dma_dst = [torch.empty(size, dtype=torch.uint8, device=device) for _, size in mapped.maps]
        sizes = [os.path.getsize(f) for f in staged]
        segments = [
            Segment(path, 0, size, i, 0, os.path.basename(path))
            for i, (path, size) in enumerate(zip(staged, sizes, strict=True))
        ]
        for read_threads in (8, 12):
            options = ReaderOptions(threads=read_threads, chunk_bytes=8 << 20)
            best = float("inf")
            for _ in range(repeat + 1):  # the first run allocates the pinned staging
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with ThreadPoolExecutor(1) as pool:
                    dma_errors = pool.submit(mapped.pipeline, dma_dst, 4, 64 << 20)
                    buffers, sink, _ = read_segments(segments, sizes, device, options)
                    sink.finish()
                    errors = dma_errors.result()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            print(
                f"hybrid.dma{share:.0%}.dma_threads4.read_threads{read_threads}: "
                f"{total / best / 1e9:.1f} GB/s ({total / 1e9:.2f} GB in {best:.3f} s), "
                f"CUDA errors {errors}"
            )
        intact = all(
            torch.equal(d.cpu(), h) for d, h in zip(dma_dst, mapped.host, strict=True)
        ) and all(
            torch.equal(b.cpu(), torch.from_file(f, size=n, dtype=torch.uint8))
            for b, f, n in zip(buffers, staged, sizes, strict=True)
        )
        print(f"hybrid.dma{share:.0%}.bytes_intact: {intact}")
        del buffers
        mapped.close()
        del dma_dst
        torch.cuda.empty_cache()
    return 0


def summary(path: str) -> int:
    """GB/s per GPU (TP=1, one GPU: checkpoint bytes / median wall) of every rayload case,
    its effective method, and the 35 GB/s page-cache target."""
    with open(path) as f:
        result: dict[str, Any] = json.load(f)
    failed = False
    for s in result["summary"]:
        if s["tp_size"] != 1 or s["kind"] != "rayload":
            continue
        gbps = s["gbps"]
        line = (
            f"{s['cache']}.{s['case']}: {gbps:.1f} GB/s per GPU, effective "
            f"{','.join(s['effective']) or '-'}, runs {s['runs']}"
        )
        if s["cache"] == "warm":
            met = gbps >= TARGET_GBPS
            line += (
                f", target >= {TARGET_GBPS:g} GB/s from page cache: {'met' if met else 'MISSED'}"
            )
        print(line)
        failed |= s["runs"] == 0
    for sample in result["samples"]:
        for rank in sample["ranks"]:
            if rank.get("fallback_reason"):
                print(f"fallback: {sample['case']} ({sample['cache']}): {rank['fallback_reason']}")
    for problem in result["consistency"]:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if failed or result["consistency"] else 0


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["probe"]
    if command == "probe":
        sys.exit(probe())
    if command == "h2d":
        sys.exit(h2d(float(rest[0]) if rest else 4.0))
    if command == "sweep":
        sys.exit(sweep(rest[0]))
    if command == "first":
        sys.exit(first(rest[0], [int(n) for n in rest[1:]] or [8, 12, 16]))
    if command == "register":
        sys.exit(register(rest[0]))
    if command == "hybrid":
        sys.exit(hybrid(rest[0]))
    if command == "summary":
        sys.exit(summary(rest[0]))
    sys.exit(
        f"unknown command {command!r}; use probe, h2d, sweep, first, register, hybrid or summary"
    )
