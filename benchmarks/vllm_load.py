"""Inside vLLM: ``load_format="rayload"`` vs vLLM's ``auto`` (and ``fastsafetensors``), per
worker, interleaved in one run, at TP 1 and TP 2 (issues #23, #30).

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vllm_load.py [--size-mb 350]
        [--file-mb N] [--tp 1,2] [--rounds 5] [--cache warm|cold]
        [--formats rayload,rayload[staged],auto] [--batch-mb 32] [--json FILE]

One engine per TP size is started with ``load_format="dummy"`` (TP 2 through vLLM's mp
executor, one CPU per worker). Each format is first loaded once, untimed (a warm-up:
the first large allocation of a process is slow, whichever loader makes it). Then each
round loads the checkpoint once per format in every worker at once (``collective_rpc``),
a different format leading each round (A B C, B C A, C A B, ...): vLLM's own
``load_model`` of that format's loader, building a fresh copy of the worker's model and
filling it, exactly as the engine does at start-up (the engine's live model stays as it
is). Before each load the checkpoint's files are read through (``--cache warm``, the
default: every load reads from the page cache) or their pages are dropped
(``--cache cold``: ``posix_fadvise(POSIX_FADV_DONTNEED)``: every load reads the disk).

Formats (``--formats``): ``rayload`` (the defaults: every tensor whose region of a vLLM
parameter is a plain one is read straight into it), ``rayload[staged]``
(``model_loader_extra_config={"direct": False}``: every tensor read into a buffer, then
copied by vLLM's weight loaders, in batches of 1 GiB of the shard: the loader before
#30), ``rayload[batches]`` (staged, in batches of at most ``--batch-mb`` of the shard),
vLLM's ``auto`` (``safe_open`` maps every file; each rank copies its part of every
tensor out of the mapping), vLLM's ``fastsafetensors``, and ``rayload[fastsafetensors]``
(rayload's ``fastsafetensors`` method, on CPU). ``--file-mb N`` writes the checkpoint in
files of at most N MB (transformers' ``max_shard_size``; default one file).

Per worker and load, from its ``/proc/self/io`` around the call:

* ``rchar``: bytes through ``read()``-family calls (rayload's reads; not ``mmap``);
* ``read_bytes``: bytes the process made the disk deliver, page faults of a mapped file
  and the kernel's readahead included (what ``auto`` reads shows up here, not in
  ``rchar``). With every worker loading at once they share the page cache, so a page
  counts for whichever worker faulted it first; at TP > 1 the bench therefore also loads
  each format in one worker at a time (after the rounds, untimed) for what a worker
  makes the disk read by itself;
* ``Loading weights took``: the figure vLLM logs (``DefaultModelLoader``'s own counters;
  its line is logged once per process, so the bench reads the counters the line is made
  of) and rayload's loader logs (its load record's ``seconds``);
* ``load_model``: model init + weights + vLLM's post-processing;
* ``peak RSS``: the worker's peak resident memory above its resident memory before the
  call (``VmHWM``, reset through ``/proc/self/clear_refs`` after ``malloc_trim``, so that
  no page an earlier load left to the allocator hides a new one), to the end of the
  weights (the fresh model's parameters plus what the loader holds beside them, and for
  ``auto`` the mapped file pages it touched) and to the end of ``load_model`` (vLLM's
  post-processing on CPU packs every linear weight into a new buffer while the old one
  is still there);
* rayload's phases (its load record's report), for where its time goes.

Prints, per TP size, the medians over rounds, each with the median of its per-round
ratios to ``auto`` and every round's ratio; ``--json FILE`` keeps every sample.
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

FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    "rayload": ("rayload", {}),
    "rayload[staged]": ("rayload", {"direct": False}),
    "rayload[no-prefault]": ("rayload", {}),  # rayload.loading.reader.pages.enabled False
    "rayload[batches]": ("rayload", {"direct": False}),  # batch_bytes from --batch-mb (main)
    "auto": ("auto", {}),
    "fastsafetensors": ("fastsafetensors", {}),
    "rayload[fastsafetensors]": ("rayload", {"method": "fastsafetensors"}),
}
"""Label -> (vLLM ``load_format``, ``model_loader_extra_config``), in the order of a round
(``--formats`` picks some)."""
DEFAULT_FORMATS = "rayload,rayload[staged],auto"
RESULT = "VLLM-BENCH-RESULT "
_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
"""1 GiB of KV cache; ``collective_rpc`` may send the load (a function) to the workers."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=350)
    parser.add_argument("--file-mb", type=int, help="files of at most this many MB")
    parser.add_argument("--batch-mb", type=float, default=32, help="rayload[batches]' budget")
    parser.add_argument("--tp", default="1,2", help="TP sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help="comma-separated labels")
    parser.add_argument(
        "--cache",
        choices=("warm", "cold"),
        default="warm",
        help="the checkpoint's pages in the page cache before each load, or dropped",
    )
    parser.add_argument("--workdir", default="/tmp/rayload-vllm-bench")
    parser.add_argument("--json", help="write every sample here")
    parser.add_argument("--engine", type=int, help=argparse.SUPPRESS)  # the child: the
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)  # engine of one TP size
    args = parser.parse_args()
    FORMATS["rayload[batches]"][1]["batch_bytes"] = int(args.batch_mb * (1 << 20))
    for label in [f for f in FORMATS if f not in args.formats.split(",")]:
        del FORMATS[label]
    if args.engine:
        _child(Path(args.checkpoint), args.engine, args.rounds, args.cache)
        return
    files = f"-{args.file_mb}mb-files" if args.file_mb else ""
    directory = Path(args.workdir) / f"llama-{args.size_mb}mb{files}"
    checkpoint = _checkpoint(directory, args.size_mb, args.file_mb)
    load_before = os.getloadavg()
    runs = [_engine(checkpoint, int(tp), args) for tp in args.tp.split(",")]
    load_after = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    files = _files(checkpoint)
    print(
        f"checkpoint {checkpoint}: {len(files)} file(s), "
        f"{sum(f.stat().st_size for f in files) / 1e6:.1f} MB; {args.rounds} rounds, "
        f"interleaved, {args.cache} page cache; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after "
        f"({len(os.sched_getaffinity(0))} CPUs)"
    )
    for run in runs:
        print(_table(run))


def _checkpoint(directory: Path, size_mb: int, file_mb: int | None) -> Path:
    """A Llama (GQA, untied lm_head, float32) of about ``size_mb`` (in files of at most
    ``file_mb``), written by transformers once and reused."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, inter, vocab = 1024, 2816, 16384
    per_layer = 2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * inter
    layers = max(1, round((size_mb * 1e6 / 4 - 2 * vocab * hidden) / per_layer))
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    files = {"max_shard_size": f"{file_mb}MB"} if file_mb else {}
    model.save_pretrained(directory, safe_serialization=True, **files)
    return directory


def _files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def _engine(checkpoint: Path, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every round of one TP size, in a child process of its own (one vLLM engine)."""
    command = [sys.executable, __file__, "--engine", str(tp), "--rounds", str(args.rounds)]
    command += ["--batch-mb", str(args.batch_mb), "--formats", args.formats]
    command += ["--cache", args.cache]
    out = subprocess.run(
        [*command, "--checkpoint", str(checkpoint)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **_ENV, "VLLM_CPU_OMP_THREADS_BIND": _bind(tp)},
    )
    log = out.stdout + out.stderr
    results = [line[len(RESULT) :] for line in log.splitlines() if line.startswith(RESULT)]
    if out.returncode or not results:
        sys.exit(f"tp {tp}: the engine failed (exit {out.returncode}):\n{log[-3000:]}")
    return json.loads(results[-1])


def _bind(tp: int) -> str:
    """One CPU per worker (TP 1: every CPU of this process)."""
    cpus = sorted(os.sched_getaffinity(0))
    if tp == 1:
        return ",".join(map(str, cpus))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(tp))


def _child(checkpoint: Path, tp: int, rounds: int, cache: str) -> None:
    started = time.perf_counter()
    llm = start_engine(checkpoint, tp)
    startup_s = time.perf_counter() - started
    warmup = {label: _load(llm, checkpoint, label, cache=cache) for label in FORMATS}
    samples = []
    labels = list(FORMATS)
    for round_ in range(rounds):
        shift = round_ % len(labels)  # each format leads a round in turn
        for label in labels[shift:] + labels[:shift]:
            workers = _load(llm, checkpoint, label, cache=cache)
            samples.append({"round": round_, "format": label, "workers": workers})
            print(f"tp {tp} round {round_} {label}: {workers}", file=sys.stderr, flush=True)
    alone = {}
    if tp > 1 and cache == "cold":  # each worker alone: what it makes the disk read
        alone = {
            label: [_load(llm, checkpoint, label, r, cache="cold")[r] for r in range(tp)]
            for label in FORMATS
        }
    result = {
        "tp": tp,
        "cache": cache,
        "startup_s": startup_s,
        "samples": samples,
        "alone": alone,
        "warmup": warmup,
    }
    print(RESULT + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


def start_engine(checkpoint: Path, tp: int) -> Any:
    """A vLLM engine of ``checkpoint`` at TP ``tp`` with dummy weights, whose workers the
    bench then loads into (:func:`load_once`)."""
    from vllm import LLM

    return LLM(
        model=str(checkpoint),
        load_format="dummy",
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=1,
    )


def _load(
    llm: Any, checkpoint: Path, label: str, only_rank: int | None = None, *, cache: str
) -> list[Any]:
    """One load of format ``label`` in every worker (or ``only_rank``) at once, from a
    warm page cache (every file read through first) or a cold one (``cache``)."""
    for path in _files(checkpoint):
        if cache == "cold":
            _drop_cached(path)
        else:
            _read_through(path)
    load_format, extra = FORMATS[label]
    workers: list[Any] = llm.collective_rpc(load_once, args=(load_format, extra, only_rank, label))
    return workers


def _read_through(path: Path) -> None:
    """Read ``path`` whole, so that its pages are in the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def _drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_once(
    worker: Any,
    load_format: str,
    extra: dict[str, str],
    only_rank: int | None = None,
    label: str = "",
    weights: str = "",
) -> dict[str, Any]:
    """Runs in each worker (``only_rank``: in that one, the others return at once):
    vLLM's ``load_model`` of ``load_format`` into a fresh copy of the worker's model
    (whose attention layers register under the live model's names in vLLM's forward
    context, put back afterwards); what it read and how long it took. ``weights`` is
    where the weights are, when not beside config.json (vLLM's ``model_weights``: an
    ``s3://`` URL for its ``runai_streamer``)."""
    import dataclasses
    import gc

    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader import get_model_loader

    from rayload.integrations.vllm import last_load

    rank = get_tensor_model_parallel_rank()
    if only_rank is not None and rank != only_rank:
        return {"rank": rank}
    config = worker.vllm_config
    load_config = dataclasses.replace(
        config.load_config, load_format=load_format, model_loader_extra_config=dict(extra)
    )
    loader = get_model_loader(load_config)
    from rayload.loading.reader import pages

    pages.enabled = label != "rayload[no-prefault]"
    context = config.compilation_config.static_forward_context
    live = dict(context)
    context.clear()
    own_weights = config.model_config.model_weights
    config.model_config.model_weights = weights or own_weights
    error = None
    gc.collect()
    _trim_heap()
    rss_before = _reset_peak_rss()
    weights_peak = _peak_after(loader)
    load_weights_s = _time_load_weights(loader)
    before = _proc_io()
    vm_before = _vmstat()
    started = time.perf_counter()
    try:
        with set_current_vllm_config(config):
            model = loader.load_model(config, config.model_config)
        del model
    except Exception as exc:  # the sample records it: vLLM's fastsafetensors on CPU
        error = f"{type(exc).__name__}: {exc}"
    finally:
        context.clear()
        context.update(live)
        config.model_config.model_weights = own_weights
    load_model_s = time.perf_counter() - started
    after = _proc_io()
    vm_after = _vmstat()
    peak_rss = _status_kb("VmHWM") * 1024
    gc.collect()
    record = last_load() if load_format == "rayload" else None
    weights_s = (
        record.seconds
        if record is not None
        else getattr(loader, "counter_after_loading_weights", 0.0)
        - getattr(loader, "counter_before_loading_weights", 0.0)
    )
    return {
        "rank": rank,
        "error": error,
        "rchar": after["rchar"] - before["rchar"],
        "read_bytes": after["read_bytes"] - before["read_bytes"],
        "vmstat": {key: vm_after[key] - vm_before[key] for key in vm_before},
        "weights_s": None if error else weights_s,
        "load_model_s": None if error else load_model_s,
        "load_weights_s": None if error else load_weights_s.get("s"),
        "requests": None if record is None else record.report.requests,
        "retries": None if record is None else record.report.retries,
        "peak_rss_above": peak_rss - rss_before,
        "weights_peak_rss_above": weights_peak[0] - rss_before if weights_peak else None,
        "param_bytes": weights_peak[1] if weights_peak else None,
        "shard_bytes": None if record is None else record.shard_bytes,
        "direct_bytes": None if record is None else record.direct_bytes,
        "phases": None
        if record is None
        else [(p.name, (p.end_ns - p.start_ns) / 1e6) for p in record.report.phases],
        "method": None if record is None else record.report.method.effective.value,
    }


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _time_load_weights(loader: Any) -> dict[str, float]:
    """Time ``loader.load_weights`` (what ``load_model`` calls between building the model
    and post-processing it) by the bench's own clock, the same for every format (vLLM's
    ``runai_streamer`` logs no time of its own); the seconds land in the returned dict."""
    timed: dict[str, float] = {}
    load_weights = loader.load_weights

    def timed_load_weights(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return load_weights(*args, **kwargs)
        finally:
            timed["s"] = time.perf_counter() - started

    loader.load_weights = timed_load_weights
    return timed


def _trim_heap() -> None:
    """Give the memory the allocator keeps after frees back to the system
    (``malloc_trim``), so that a load's new allocations show in its peak RSS instead of
    reusing pages an earlier load left resident."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _peak_after(loader: Any) -> list[int]:
    """Wrap ``loader.load_weights``: once it has run, the returned list holds the peak
    RSS so far (``VmHWM``, bytes: the model's parameters and what the loader held beside
    them, before vLLM's post-processing) and the bytes of the model's parameters."""
    seen: list[int] = []
    load_weights = loader.load_weights

    def wrapped(model: Any, model_config: Any) -> None:
        load_weights(model, model_config)
        seen[:] = [
            _status_kb("VmHWM") * 1024,
            sum(p.numel() * p.element_size() for p in model.parameters()),
        ]

    loader.load_weights = wrapped
    return seen


def _reset_peak_rss() -> int:
    """Reset this process's ``VmHWM`` to its current RSS; returns that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


_VMSTAT = ("thp_fault_alloc", "thp_fault_fallback", "pgfault")


def _vmstat() -> dict[str, int]:
    """The machine's counters of page faults and of transparent huge pages given to them
    (``/proc/vmstat``: every process's, so only a sign of what one load did)."""
    with open("/proc/vmstat") as f:
        counts = dict(line.split() for line in f)
    return {key: int(counts.get(key, 0)) for key in _VMSTAT}


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {key: int(value) for key, value in (line.split(": ") for line in f)}


def _table(run: dict[str, Any]) -> str:
    """Medians over rounds; each ratio is the median of the rounds' ratios to ``auto``."""
    tp, samples = run["tp"], run["samples"]
    auto = {s["round"]: s for s in samples if s["format"] == "auto"}
    lines = [
        f"\ntp {tp} (engine start-up {run['startup_s']:.0f} s with load_format='dummy'); "
        "per worker rank 0 / rank 1 ...; times: the slowest worker",
        "| format | rchar per worker (MB) | read_bytes per worker (MB), all at once | "
        "read_bytes, each worker alone (MB) | Loading weights took (s) | load_model (s) | "
        "peak RSS above start per worker, to the end of the weights (MB) | the same, "
        "to the end of load_model (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label in FORMATS:
        mine = [s for s in samples if s["format"] == label]
        errors = {w["error"] for s in mine for w in s["workers"] if w["error"]}
        if errors:
            lines.append(f"| {label} | fails: {' / '.join(sorted(errors))} | | | | | | |")
            continue
        cells = [
            " / ".join(
                f"{statistics.median(s['workers'][r][key] for s in mine) / 1e6:.1f}"
                for r in range(tp)
            )
            for key in ("rchar", "read_bytes")
        ]
        alone = run["alone"].get(label)
        not_measured = "(tp 1)" if tp == 1 else "(warm cache)"
        cells.append(
            " / ".join(f"{w['read_bytes'] / 1e6:.1f}" for w in alone) if alone else not_measured
        )
        for key in ("weights_s", "load_model_s"):
            slowest = {s["round"]: max(w[key] for w in s["workers"]) for s in mine}
            base = {r: max(w[key] for w in auto[r]["workers"]) for r in slowest}
            ratios = [slowest[r] / base[r] for r in sorted(slowest)]
            every = ", ".join(f"{x:.2f}" for x in ratios)
            cells.append(
                f"{statistics.median(slowest.values()):.3f} ({statistics.median(ratios):.2f}x; "
                f"rounds {every})"
            )
        for key in ("weights_peak_rss_above", "peak_rss_above"):
            cells.append(
                " / ".join(
                    f"{statistics.median(s['workers'][r][key] for s in mine) / 1e6:.0f}"
                    for r in range(tp)
                )
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ray = [s for s in samples if s["format"] == "rayload"]
    if ray:
        workers = ray[0]["workers"]
        shards = " / ".join(f"{w['shard_bytes'] / 1e6:.1f}" for w in workers)
        direct = " / ".join(f"{w['direct_bytes'] / 1e6:.1f}" for w in workers)
        params = " / ".join(f"{w['param_bytes'] / 1e6:.1f}" for w in workers)
        lines.append(
            f"rayload's shard per worker: {shards} MB, of which straight into vLLM's "
            f"parameters: {direct} MB (method {workers[0]['method']}); the parameters: "
            f"{params} MB; peak RSS: medians over rounds"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
