"""Side by side: boto3 vs obstore fetching one object as concurrent ranged GETs into a
preallocated buffer, against a local moto S3 server (interleaved A B A B).

    python benchmarks/s3_clients.py [--mib 256] [--chunk-mib 8] [--inflight 16] [--rounds 3]

Prints MB/s per client and round. The figures in docs/design.md "Object storage" came
from this script.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _run(f"http://127.0.0.1:{port}", args)
    finally:
        server.terminate()
        server.wait()


def _run(endpoint: str, args: argparse.Namespace) -> None:
    import boto3
    import botocore.config
    import obstore
    from obstore.store import S3Store

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=botocore.config.Config(max_pool_connections=args.inflight),
    )
    for _ in range(100):
        try:
            client.create_bucket(Bucket="bench")
            break
        except Exception:  # the server is still starting
            time.sleep(0.1)
    size = args.mib << 20
    client.put_object(Bucket="bench", Key="blob", Body=os.urandom(size))
    chunk = args.chunk_mib << 20
    starts = list(range(0, size, chunk))
    store = S3Store(
        "bench",
        endpoint=endpoint,
        region="us-east-1",
        client_options={"allow_http": True},
        virtual_hosted_style_request=False,
    )
    pool = ThreadPoolExecutor(args.inflight)
    dest = bytearray(size)
    view = memoryview(dest)

    def boto3_one(start: int) -> None:
        end = min(size, start + chunk)
        body = client.get_object(Bucket="bench", Key="blob", Range=f"bytes={start}-{end - 1}")[
            "Body"
        ]
        got = 0
        while got < end - start:
            n = body._raw_stream.readinto(view[start + got : end])
            if not n:
                raise RuntimeError("short body")
            got += n

    def boto3_all() -> None:
        list(pool.map(boto3_one, starts))

    def obstore_all() -> None:
        ends = [min(size, s + chunk) for s in starts]
        for s, e, data in zip(
            starts, ends, obstore.get_ranges(store, "blob", starts=starts, ends=ends), strict=True
        ):
            view[s:e] = memoryview(data)

    def boto3_read_one(start: int) -> None:
        end = min(size, start + chunk)
        body = client.get_object(Bucket="bench", Key="blob", Range=f"bytes={start}-{end - 1}")[
            "Body"
        ]
        view[start:end] = body.read()

    def obstore_one(start: int) -> None:
        end = min(size, start + chunk)
        view[start:end] = memoryview(obstore.get_range(store, "blob", start=start, end=end))

    cases = {
        "boto3 (threads, readinto)": boto3_all,
        "boto3 (threads, read)": lambda: list(pool.map(boto3_read_one, starts)),
        "obstore (threads, get_range)": lambda: list(pool.map(obstore_one, starts)),
        "obstore (get_ranges)": obstore_all,
    }
    for round_ in range(args.rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            print(
                f"round {round_}  {name:28s} {size / dt / 1e6:8.1f} MB/s  ({dt:.2f} s)", flush=True
            )


if __name__ == "__main__":
    main()
