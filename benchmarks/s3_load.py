"""Loading a TP=4 checkpoint from S3, side by side in one run (issue #21 step 9), against
one S3 server: moto on 127.0.0.1 behind the tests' counting proxy (tests/support/s3.py),
which counts the bytes it serves. Interleaved: each round runs every case once.

    PYTHONPATH=src:tests python benchmarks/s3_load.py [--layers 4] [--rounds 2]

Cases (one fresh spawned process per rank, all released at once by a barrier; a case's
time is from the release until the last rank has its shards):

* ``rayload``: each rank runs :func:`rayload.load_rank` on the ``s3://`` checkpoint as
  ``rayload.load``'s rank actors do: in the load's process group (gloo, joined before
  the clock, as ``rank.process_group`` precedes the read), given the driver's opened
  checkpoint (the plan every case gets before the clock), it sends only its own byte
  ranges as ranged GETs, straight into its tensors, and the group fetches each split-1
  tensor once (one rank whole, scattering the columns: ``loading/reader/group``);
* ``rayload-unshared``: the same without the process group: each rank fetches its
  split-1 rows as runs, other ranks' columns included;
* ``rayload-headers``: ``rayload-unshared`` with each rank opening the checkpoint itself
  (listing it and reading every header, as a rank on its own does: a vLLM worker);
* ``rayload-converted``: ``rayload`` from the checkpoint converted for TP=4;
* ``runai``: Run:ai Model Streamer (``runai-model-streamer`` and
  ``runai-model-streamer-s3``, the path behind vLLM's ``runai_streamer``), each rank
  streaming every file and keeping its shard of each tensor (vLLM's non-distributed
  mode);
* ``download``: each rank downloads the files with boto3 (s3transfer) into a temporary
  directory, then ``safe_open`` s them and takes its shard of each tensor;
* ``limit``: the server's limit: the GETs the ``rayload`` case sent in the same round
  (the proxy's log: the same ranges, so the same bytes and request sizes), each rank
  every fourth of them in the order the server got them, replayed raw with the same
  client (boto3, configured as rayload's), 16 in flight per rank, into a buffer each,
  building no tensor.
* ``limit-1x``: each rank fetches a quarter of the files' bytes (the checkpoint once) as
  raw ranged GETs of 4 MiB, 16 in flight: what any loader of these files needs at least
  in bytes (not in time: moto copies a whole object per GET, so 4 MiB GETs of 6 MB
  objects cost it more than fewer larger ones; the converted layout beats it).

``--server-mbps N`` makes the proxy send bodies at N MB/s for all connections together,
as one link to a remote store of that speed would: a run bound by the store's bandwidth
rather than by this machine's CPU (label its figures so).

Reported per case: the time, the bytes the proxy served (over the checkpoint's), the
peak RSS of the ranks (each process's ``VmHWM``, and above its RSS at the barrier).
Then, on a local Ray cluster, 4 TP=2 replicas with peers (``auto``) against without
(``scratch``): time of ``rayload.load`` and bytes served, then of the same replicas'
``reload()`` in place (actors up: the bytes' movement alone).

moto copies the whole object on every GET (``FakeKey.value``), so a request costs time in
proportion to its object's size: the checkpoint's files are kept small (one file per few
tensors) so that the server measures requests and bytes, not moto's copies.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TP = 4
_LIMIT_GET = 4 << 20
CASES = (
    "rayload",
    "rayload-unshared",
    "rayload-headers",
    "rayload-converted",
    "runai",
    "download",
    "limit",
    "limit-1x",
)
Range = tuple[str, int, int]
"""(url, start, end): the bytes ``start:end`` of one object."""


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _hwm_mb() -> float:
    """This process's peak RSS (``VmHWM``: since its exec, unlike ``ru_maxrss``, which a
    spawned child inherits from the parent it was forked from)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1e3


def _rank_main(
    case: str, url: str, rank: int, replay: list[Range], barrier: Any, out: Any, port: int
) -> None:
    os.environ["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
    run = _prepare(case, url, rank, replay, port)
    base = _rss_mb()
    barrier.wait()
    start = time.time()
    nbytes = run()
    end = time.time()
    peak = _hwm_mb()
    out.put((rank, start, end, peak, base, nbytes))


def _prepare(case: str, url: str, rank: int, replay: list[Range], port: int) -> Callable[[], int]:
    """Import and set up what ``case`` needs (before the clock starts); the returned
    function loads rank ``rank``'s shards and returns their bytes (``limit``: replays
    ``replay``'s GETs)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from rayload.loading import load_rank, open_checkpoint, plan_shards

    checkpoint = open_checkpoint(url)  # headers (not timed: every case needs the plan)
    if case.startswith("rayload"):
        given = None if case == "rayload-headers" else checkpoint
        group = None
        if case in ("rayload", "rayload-converted"):
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP
            )
            group = dist.group.WORLD

        def rayload_rank() -> int:
            tensors, _ = load_rank(url, rank, TP, "auto", checkpoint=given, group=group)
            return sum(t.numel() * t.element_size() for t in tensors.values())

        return rayload_rank
    shards = {s.name: s for s in plan_shards(checkpoint, TP).ranks[rank].shards}
    if case == "runai":
        from runai_model_streamer import SafetensorsStreamer

        def runai_rank() -> int:
            out = {}
            with SafetensorsStreamer() as streamer:
                streamer.stream_files(list(checkpoint.files), owned=False)
                for name, tensor in streamer.get_tensors():
                    out[name] = _shard_of(tensor, shards[name])
            return sum(t.numel() * t.element_size() for t in out.values())

        return runai_rank
    if case == "download":
        import boto3
        from safetensors import safe_open

        client = boto3.client("s3")  # a user's download: boto3's defaults

        def download_rank() -> int:
            out = {}
            with tempfile.TemporaryDirectory() as tmp:
                for f in checkpoint.files:
                    bucket, _, key = f.removeprefix("s3://").partition("/")
                    local = os.path.join(tmp, key.rpartition("/")[2])
                    client.download_file(bucket, key, local)
                    with safe_open(local, "pt") as st:
                        for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                            out[name] = _shard_of(st.get_tensor(name), shards[name])
            return sum(t.numel() * t.element_size() for t in out.values())

        return download_rank
    from concurrent.futures import ThreadPoolExecutor

    from rayload.loading.storage.s3_client import make_client

    client = make_client(3.0, 30.0)[0]  # rayload's client: its pool, time-outs, checksums
    ranges = _quarter(replay, rank) if case == "limit" else _limit_1x(checkpoint.files, rank)

    def get(item: Range) -> int:
        f, a, b = item
        bucket, _, key = f.removeprefix("s3://").partition("/")
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={a}-{b - 1}")["Body"]
        buffer = bytearray(b - a)
        view, got = memoryview(buffer), 0
        while got < len(buffer):
            n = body.readinto(view[got:])
            if not n:
                break
            got += n
        return got

    def limit_rank() -> int:
        with ThreadPoolExecutor(16) as pool:
            return sum(pool.map(get, ranges))

    return limit_rank


def _quarter(ranges: list[Range], rank: int) -> list[Range]:
    """Rank ``rank``'s share of ``ranges`` (in the order the server got them, every
    TP-th: each rank's requests spread over the files as rayload's ranks' were)."""
    return ranges[rank::TP]


def _limit_1x(files: tuple[str, ...], rank: int) -> list[Range]:
    """Rank ``rank``'s quarter of the concatenated files, as 4 MiB GETs."""
    from rayload.loading.storage import storage_for

    sizes = [(f, storage_for(f).size(f)) for f in files]
    total = sum(n for _, n in sizes)
    first, last = total * rank // TP, total * (rank + 1) // TP
    ranges, pos = [], 0
    for f, n in sizes:
        lo, hi = max(first, pos), min(last, pos + n)
        for a in range(lo, hi, _LIMIT_GET):
            ranges.append((f, a - pos, min(hi, a + _LIMIT_GET) - pos))
        pos += n
    return ranges


def _gets(proxy: Any, url: str) -> list[Range]:
    """The ranged GETs the proxy served under ``url`` since its last clear, in order."""
    bucket = url.removeprefix("s3://").partition("/")[0]
    out = []
    for r in proxy.requests(url.removeprefix("s3://") + "/"):
        if r.method == "GET" and r.range is not None:
            first, _, last = r.range.removeprefix("bytes=").partition("-")
            out.append((f"s3://{bucket}/{r.key.partition('/')[2]}", int(first), int(last) + 1))
    return out


def _shard_of(tensor: Any, shard: Any) -> Any:
    """Rank's part of a full tensor (as a vLLM weight loader copies it), own memory."""
    import torch

    if shard.split is None or not shard.pieces:
        return tensor.clone()
    parts = [tensor.narrow(shard.split, start, length) for start, length in shard.pieces]
    return torch.cat(parts, dim=shard.split).contiguous().clone()


def _run_case(case: str, url: str, proxy: Any, replay: list[Range]) -> dict[str, Any]:
    from rayload.actors.process_group import free_port

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(TP + 1), ctx.Queue()
    port = free_port()  # the rayload cases' process group
    procs = [
        ctx.Process(target=_rank_main, args=(case, url, r, replay, barrier, out, port))
        for r in range(TP)
    ]
    for p in procs:
        p.start()
    barrier.wait(timeout=600)
    proxy.clear()  # the setup's reads (headers, for the baselines' plan) are not counted
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    served = proxy.served_bytes(url.removeprefix("s3://") + "/")
    start = min(r[1] for r in results)
    return {
        "gets": _gets(proxy, url) if case == "rayload" else [],
        "seconds": max(r[2] for r in results) - start,
        "served": served,
        "peak_rss_mb": max(r[3] for r in results),
        "peak_above_start_mb": max(r[3] - r[4] for r in results),
        "shard_mb": max(r[5] for r in results) / 1e6,
    }


def _replicas(url: str, proxy: Any, rounds: int) -> dict[str, list[tuple[float, int, float, int]]]:
    """Per method and round: the seconds of ``rayload.load`` of 4 TP=2 replicas, the
    bytes served, then the seconds of their ``reload()`` in place (the actors up: only
    the bytes move) and its bytes served."""
    import ray

    import rayload

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    prefix = url.removeprefix("s3://")
    try:
        times: dict[str, list[tuple[float, int, float, int]]] = {"auto": [], "scratch": []}
        for _ in range(rounds):
            for method in times:
                proxy.clear()
                t = time.perf_counter()
                with rayload.load(
                    url, 2, device="cpu", replicas=4, method=method, timeout=600
                ) as r:
                    elapsed = time.perf_counter() - t
                    served = proxy.served_bytes(prefix)
                    proxy.clear()
                    t = time.perf_counter()
                    r.reload(timeout=600)
                    reloaded = time.perf_counter() - t
                times[method].append((elapsed, served, reloaded, proxy.served_bytes(prefix)))
        return times
    finally:
        ray.shutdown()


def _tp4(urls: dict[str, str], proxy: Any, size: int, rounds: int) -> None:
    """The TP=4 cases, interleaved, ``rounds`` times; their table and ratios."""
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in CASES}
    for rnd in range(rounds):
        for case in CASES:
            url = urls["tp4" if case == "rayload-converted" else "hf"]
            replay = rows["rayload"][-1]["gets"] if case == "limit" else []
            r = _run_case(case, url, proxy, replay)
            rows[case].append(r)
            print(
                f"round {rnd} {case:18s} {r['seconds']:6.2f} s  served "
                f"{r['served'] / size:.3f}x  peak RSS {r['peak_rss_mb']:.0f} MB "
                f"(+{r['peak_above_start_mb']:.0f} MB, shard {r['shard_mb']:.0f} MB)",
                flush=True,
            )
    med = {c: statistics.median(r["seconds"] for r in rows[c]) for c in CASES}
    print("\n| case | time (median) | served / checkpoint | peak RSS per rank (above start) |")
    print("|---|---|---|---|")
    for c in CASES:
        last = rows[c][-1]
        print(
            f"| {c} | {med[c]:.2f} s | {last['served'] / size:.3f}x | "
            f"{max(r['peak_rss_mb'] for r in rows[c]):.0f} MB "
            f"(+{max(r['peak_above_start_mb'] for r in rows[c]):.0f} MB) |"
        )
    print(
        f"\nratios: runai / rayload {med['runai'] / med['rayload']:.2f}x (target >= 1.5), "
        f"download / rayload {med['download'] / med['rayload']:.2f}x (target >= 2), "
        f"rayload / limit (its own GETs, raw) {med['rayload'] / med['limit']:.2f}x "
        f"(target <= 1.2), rayload / limit-1x {med['rayload'] / med['limit-1x']:.2f}x, "
        f"rayload-converted / limit-1x {med['rayload-converted'] / med['limit-1x']:.2f}x, "
        f"rayload-headers / rayload {med['rayload-headers'] / med['rayload']:.2f}x, "
        f"rayload-unshared / rayload {med['rayload-unshared'] / med['rayload']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-replicas", action="store_true")
    parser.add_argument("--no-tp4", action="store_true", help="only the replicas")
    parser.add_argument(
        "--server-mbps",
        type=float,
        default=0.0,
        help="limit the server to this many MB/s of body, all connections together, as a "
        "link to a remote store would (default: none)",
    )
    args = parser.parse_args()

    from rayload.loading import open_checkpoint, synthetic
    from rayload.loading.convert import convert_checkpoint
    from support.s3 import s3_server

    # Llama's layout at a width whose split-1 rows are 0.5-2 KiB per rank at TP=4.
    synthetic.PRESETS["bench-s3"] = synthetic.LlamaShape(4096, 1024, 4096, args.layers, 8, 4, False)
    s3 = s3_server()
    with tempfile.TemporaryDirectory() as tmp:
        hf = synthetic.write_checkpoint(
            Path(tmp) / "hf", preset="bench-s3", num_files=min(args.files, 9 * args.layers + 3)
        )
        converted = convert_checkpoint(hf, Path(tmp) / "tp4", TP, part_bytes=8 << 20)
        size, files = open_checkpoint(hf).tensor_bytes, len(open_checkpoint(hf).files)
        urls = {"hf": s3.upload(hf, "bench", "hf"), "tp4": s3.upload(converted, "bench", "tp4")}
    s3.proxy.rate = args.server_mbps * 1e6
    limit = f"{args.server_mbps:g} MB/s" if args.server_mbps else "none"
    print(f"checkpoint: {size / 1e6:.0f} MB of tensors, {files} files; TP={TP}; link: {limit}")
    if not args.no_tp4:
        _tp4(urls, s3.proxy, size, args.rounds)
    if not args.no_replicas:
        times = _replicas(urls["hf"], s3.proxy, args.rounds)
        for i, what in ((0, "load"), (2, "reload in place")):
            auto = statistics.median(t[i] for t in times["auto"])
            scratch = statistics.median(t[i] for t in times["scratch"])
            print(
                f"4 TP=2 replicas, {what}: with peers {auto:.2f} s, served "
                f"{times['auto'][-1][i + 1] / size:.3f}x; without {scratch:.2f} s, served "
                f"{times['scratch'][-1][i + 1] / size:.3f}x; without / with "
                f"{scratch / auto:.2f}x (target >= 2); rounds with "
                f"{[round(t[i], 2) for t in times['auto']]}, without "
                f"{[round(t[i], 2) for t in times['scratch']]}"
            )


if __name__ == "__main__":
    sys.exit(main())
