"""Inside vLLM: ``load_format="rayload"`` vs vLLM's ``auto`` vs ``fastsafetensors``, one
engine per sample, interleaved (R A F D, R A F D, ...) in one run, on one checkpoint.

    .venv-vllm/bin/python benchmarks/vllm_load.py [--size-mb 350] [--tp 2] [--rounds 2]

Each sample is a fresh process starting ``LLM(model=..., load_format=X,
tensor_parallel_size=tp)`` (TP 2 through vLLM's mp executor) and reporting, per worker:

* ``rchar``: what the worker process read through ``read()``-family calls since it was
  spawned, less the same figure of a ``load_format="dummy"`` engine of the same round
  (``D``: the same imports and start-up, no weights read), so the difference is what the
  weights cost. ``rchar`` does not see memory-mapped reads: vLLM's ``auto`` maps each
  safetensors file and copies every tensor whole (``safe_open(...).get_tensor(name)``)
  on every rank, so its bytes show up as page faults, not here.
* vLLM's own ``Loading weights took X seconds`` line of each worker, and its ``Model
  loading took ... seconds`` (model init + weights + post-processing).
* for rayload, its load record's ``rchar`` over the load alone (``last_load()``).

Prints a table of medians and the ratios to ``auto``; ``--json FILE`` keeps every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FORMATS = ("rayload", "auto", "fastsafetensors", "dummy")
RESULT = "VLLM-BENCH-RESULT "
_WORKER = r"\((?:Worker_TP(?P<rank>\d+)|MainProcess|EngineCore\S*) pid=\d+\)"
LOADING_WEIGHTS = re.compile(_WORKER + r".*Loading weights took (?P<s>[\d.]+) seconds")
_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
"""1 GiB of KV cache; ``collective_rpc`` may send the probe (a function) to the workers."""
MODEL_LOADING = re.compile(_WORKER + r".*Model loading took .*? and (?P<s>[\d.]+) seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=350)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/rayload-vllm-bench")
    parser.add_argument("--json", help="write every sample here")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # the child: one engine of
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)  # this checkpoint
    args = parser.parse_args()
    if args.engine:
        _child(args.checkpoint, args.tp, args.engine)
        return
    checkpoint = _checkpoint(Path(args.workdir) / f"llama-{args.size_mb}mb", args.size_mb)
    samples = []
    for round_ in range(args.rounds):
        for fmt in FORMATS:
            sample = _sample(checkpoint, args.tp, fmt)
            sample["round"] = round_
            samples.append(sample)
            print(
                f"round {round_} {fmt:>16}: start-up {sample['startup_s']:.1f} s, "
                f"weights {sample['loading_weights_s']} s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(samples, indent=1))
    print(_table(samples, checkpoint, args.tp))


def _checkpoint(directory: Path, size_mb: int) -> Path:
    """A Llama (GQA, untied lm_head, float32) of about ``size_mb``, written by transformers
    once and reused."""
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
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _sample(checkpoint: Path, tp: int, fmt: str) -> dict[str, Any]:
    started = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--engine",
            fmt,
            "--tp",
            str(tp),
            "--checkpoint",
            str(checkpoint),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **_ENV, **_bind(tp)},
    )
    log = out.stdout + out.stderr
    results = [line[len(RESULT) :] for line in log.splitlines() if line.startswith(RESULT)]
    if out.returncode or not results:
        sys.exit(f"{fmt}: the engine failed (exit {out.returncode}):\n{log[-3000:]}")
    sample = json.loads(results[-1])
    sample["process_s"] = time.perf_counter() - started
    sample["loading_weights_s"] = _per_rank(LOADING_WEIGHTS, log)
    sample["model_loading_s"] = _per_rank(MODEL_LOADING, log)
    return sample


def _bind(tp: int) -> dict[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpus[r % len(cpus)]) for r in range(tp))}


def _per_rank(pattern: re.Pattern[str], log: str) -> list[float]:
    found = {int(m["rank"] or 0): float(m["s"]) for m in pattern.finditer(log)}
    return [found[r] for r in sorted(found)]


def _child(checkpoint: str, tp: int, fmt: str) -> None:
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(
        model=checkpoint,
        load_format=fmt,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=1,
    )
    startup_s = time.perf_counter() - started
    workers = llm.collective_rpc(_worker_reads)
    print(RESULT + json.dumps({"format": fmt, "startup_s": startup_s, "workers": workers}))
    llm.llm_engine.engine_core.shutdown()


def _worker_reads(worker: Any) -> dict[str, Any]:
    from rayload.integrations.vllm import last_load
    from rayload.loading.probe import read_chars

    load = last_load()
    return {
        "rchar": read_chars(),
        "load_rchar": None if load is None else load.read_chars,
        "shard_bytes": None if load is None else load.shard_bytes,
    }


def _table(samples: list[dict[str, Any]], checkpoint: Path, tp: int) -> str:
    """Medians over rounds; weight bytes are each worker's rchar less dummy's of its round."""
    dummy = {s["round"]: s for s in samples if s["format"] == "dummy"}
    tensor_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    rows = {}
    for fmt in FORMATS[:-1]:
        mine = [s for s in samples if s["format"] == fmt]
        weights = [
            [
                w["rchar"] - d["rchar"]
                for w, d in zip(s["workers"], dummy[s["round"]]["workers"], strict=True)
            ]
            for s in mine
        ]
        rows[fmt] = {
            "rchar_mb": [statistics.median(w[r] for w in weights) / 1e6 for r in range(tp)],
            "weights_s": statistics.median(max(s["loading_weights_s"]) for s in mine),
            "model_s": statistics.median(max(s["model_loading_s"]) for s in mine),
            "startup_s": statistics.median(s["startup_s"] for s in mine),
        }
    base = rows["auto"]
    lines = [
        f"checkpoint {checkpoint} ({tensor_bytes / 1e6:.0f} MB of safetensors), tp {tp}, "
        f"{len(dummy)} rounds (medians; ratios to auto)",
        "| format | rchar per worker (MB, less dummy) | Loading weights took (s) | "
        "Model loading took (s) | engine start-up (s) |",
        "|---|---|---|---|---|",
    ]
    for fmt, row in rows.items():
        lines.append(
            f"| {fmt} | {' / '.join(f'{mb:.1f}' for mb in row['rchar_mb'])} | "
            f"{row['weights_s']:.2f} ({row['weights_s'] / base['weights_s']:.2f}x) | "
            f"{row['model_s']:.2f} ({row['model_s'] / base['model_s']:.2f}x) | "
            f"{row['startup_s']:.1f} ({row['startup_s'] / base['startup_s']:.2f}x) |"
        )
    ray = [s for s in samples if s["format"] == "rayload"]
    shards = [w["shard_bytes"] / 1e6 for w in ray[0]["workers"]]
    loads = [statistics.median(s["workers"][r]["load_rchar"] for s in ray) / 1e6 for r in range(tp)]
    lines.append(
        f"rayload's own record: shard {' / '.join(f'{x:.1f}' for x in shards)} MB, rchar during "
        f"the load {' / '.join(f'{x:.1f}' for x in loads)} MB per worker"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
