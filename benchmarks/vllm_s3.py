"""Inside vLLM from object storage: ``load_format="rayload"`` reading ``s3://`` against
vLLM's own ``runai_streamer`` (Run:ai Model Streamer), per worker, interleaved in one run,
at TP 2 (issue #30).

    PYTHONPATH=src:tests:benchmarks .venv-vllm/bin/python benchmarks/vllm_s3.py
        [--size-mb 350] [--file-mb 50] [--tp 2] [--rounds 5] [--server-mbps 100]
        [--json FILE]

The store is the tests' real S3-protocol server (moto on 127.0.0.1 behind the counting
proxy of tests/support/s3.py), started in the engine's process before vLLM starts its
workers (they inherit its AWS environment), the checkpoint (a transformers Llama, as in
benchmarks/vllm_load.py) uploaded to it. ``--server-mbps N`` makes the proxy send bodies
at N MB/s for all connections together: one link to a remote store of that speed, which
this host emulates (label the figures so). moto copies a whole object per GET, hence
files of ``--file-mb`` (default 50 MB: 7 files).

One engine (``load_format="dummy"``, vLLM's mp executor at TP 2, one CPU per worker) is
loaded again and again as benchmarks/vllm_load.py does (:func:`vllm_load.load_once`: a
fresh model built and filled by the format's loader in every worker at once), each format
once untimed first, then a different format leading each round:

* ``rayload``: ``model_loader_extra_config={"path": "s3://..."}`` (vLLM 0.32 admits an
  ``s3://`` model for its own streamers only): each worker fetches its own ranges, the
  two ranks fetch each split-1 tensor once between them, into vLLM's parameters;
* ``runai_streamer``: vLLM's loader for object storage, its ``model_weights`` the same
  ``s3://`` URL: each worker streams every file and vLLM's weight loaders keep its part.

Per format: ``load_weights`` (the loader's ``load_weights`` call, timed by the bench the
same way for both: vLLM's ``runai_streamer`` logs no time of its own; the slowest worker;
the median of the rounds' ratios to ``runai_streamer`` and every round's), the bytes the
server sent per load over the checkpoint's bytes (the proxy's own count; every round's),
rchar and peak RSS per worker, and rayload's requests and retries per worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import vllm_load

BUCKET = "bench"
RESULT = "VLLM-S3-RESULT "
FORMATS = ("rayload", "runai_streamer")
BASE = "runai_streamer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=350)
    parser.add_argument("--file-mb", type=int, default=50)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--server-mbps", type=float, default=100.0)
    parser.add_argument("--workdir", default="/tmp/rayload-vllm-bench")
    parser.add_argument("--json", help="write every sample here")
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        _child(Path(args.checkpoint), args)
        return
    directory = Path(args.workdir) / f"llama-{args.size_mb}mb-{args.file_mb}mb-files"
    checkpoint = vllm_load._checkpoint(directory, args.size_mb, args.file_mb)
    command = [sys.executable, __file__, "--engine", "--checkpoint", str(checkpoint)]
    command += ["--tp", str(args.tp), "--rounds", str(args.rounds)]
    command += ["--server-mbps", str(args.server_mbps)]
    load_before = os.getloadavg()
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        env={
            **os.environ,
            **vllm_load._ENV,
            "VLLM_CPU_OMP_THREADS_BIND": vllm_load._bind(args.tp),
        },
    )
    log = out.stdout + out.stderr
    results = [line[len(RESULT) :] for line in log.splitlines() if line.startswith(RESULT)]
    if out.returncode or not results:
        sys.exit(f"the engine failed (exit {out.returncode}):\n{log[-3000:]}")
    run = json.loads(results[-1])
    load_after = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(run, indent=1))
    print(
        f"checkpoint {checkpoint}: {run['files']} files, {run['checkpoint_bytes'] / 1e6:.1f} "
        f"MB in s3:// (moto behind the counting proxy at {args.server_mbps:g} MB/s: an "
        f"emulated link); TP {args.tp}; {args.rounds} rounds, interleaved; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print(_table(run))


def _child(checkpoint: Path, args: argparse.Namespace) -> None:
    from support.s3 import s3_server

    server = s3_server()  # sets the AWS environment the workers inherit
    url = server.upload(checkpoint, BUCKET, checkpoint.name)
    server.proxy.rate = args.server_mbps * 1e6
    files = vllm_load._files(checkpoint)
    started = time.perf_counter()
    llm = vllm_load.start_engine(checkpoint, args.tp)
    startup_s = time.perf_counter() - started
    loads = {
        "rayload": ("rayload", {"path": url}, ""),
        "runai_streamer": ("runai_streamer", {}, url),
    }

    def load(label: str) -> dict[str, Any]:
        load_format, extra, weights = loads[label]
        before = server.proxy.served_bytes(f"{BUCKET}/")
        workers = llm.collective_rpc(
            vllm_load.load_once, args=(load_format, extra, None, label, weights)
        )
        served = server.proxy.served_bytes(f"{BUCKET}/") - before
        return {"format": label, "workers": workers, "served": served}

    warmup = [load(label) for label in FORMATS]
    samples = []
    for round_ in range(args.rounds):
        shift = round_ % len(FORMATS)
        for label in FORMATS[shift:] + FORMATS[:shift]:
            sample = {"round": round_, **load(label)}
            samples.append(sample)
            print(f"round {round_} {label}: {sample}", file=sys.stderr, flush=True)
    result = {
        "tp": args.tp,
        "startup_s": startup_s,
        "files": len(files),
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "server_mbps": args.server_mbps,
        "samples": samples,
        "warmup": warmup,
    }
    print(RESULT + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


def _table(run: dict[str, Any]) -> str:
    """Medians over rounds; each ratio is the median of the rounds' ratios to runai's."""
    samples, total = run["samples"], run["checkpoint_bytes"]
    tp = run["tp"]
    base = {s["round"]: _slowest(s) for s in samples if s["format"] == BASE}
    lines = [
        "| format | load_weights (s), slowest worker | its time / runai_streamer's | "
        "bytes served per load / checkpoint | rchar per worker (MB) | peak RSS above start "
        "per worker, to the end of the weights (MB) | rayload's requests (retries) per "
        "worker |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in FORMATS:
        mine = [s for s in samples if s["format"] == label]
        errors = {w["error"] for s in mine for w in s["workers"] if w["error"]}
        if errors:
            lines.append(f"| {label} | fails: {' / '.join(sorted(errors))} | | | | | |")
            continue
        slowest = {s["round"]: _slowest(s) for s in mine}
        ratios = [slowest[r] / base[r] for r in sorted(slowest)]
        served = statistics.median(s["served"] for s in mine) / total
        every_served = ", ".join(f"{s['served'] / total:.3f}" for s in mine)
        rchar, rss = (
            " / ".join(
                f"{statistics.median(s['workers'][r][key] for s in mine) / 1e6:.1f}"
                for r in range(tp)
            )
            for key in ("rchar", "weights_peak_rss_above")
        )
        requests = " / ".join(
            "n/a"
            if mine[0]["workers"][r].get("requests") is None
            else f"{statistics.median(s['workers'][r]['requests'] for s in mine):.0f} "
            f"({sum(s['workers'][r]['retries'] for s in mine)} in all rounds)"
            for r in range(tp)
        )
        lines.append(
            f"| {label} | {statistics.median(slowest.values()):.2f} | "
            f"{statistics.median(ratios):.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)}) "
            f"| {served:.3f}x (rounds {every_served}) "
            f"| {rchar} | {rss} | {requests} |"
        )
    return "\n".join(lines)


def _slowest(sample: dict[str, Any]) -> float:
    return max(w["load_weights_s"] for w in sample["workers"])


if __name__ == "__main__":
    main()
