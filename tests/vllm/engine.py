"""Runs vLLM engines on one checkpoint, one after the other in this process, and writes
what each produced: ``python engine.py CHECKPOINT TP OUT LOADER [LOADER ...]``.

For each load format: the greedy tokens and their logprobs for :data:`PROMPTS`, every
worker's parameters as the load left them, and (``rayload``) each worker's
:func:`rayload.integrations.vllm.last_load`. The engines of one checkpoint and tp share
this process, so vLLM is imported once; the engine core runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), tp 2 through the mp executor.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import sys
import time
from typing import Any

PROMPTS = ([1, 2, 3, 4, 5], [17, 9, 101, 42], [150, 7, 7, 7, 7, 7, 60, 3])
MAX_TOKENS = 8
LOGPROBS = 2


def _worker_state(model: Any) -> dict[str, Any]:
    """Runs in each worker: its parameters (cloned) and its rayload load, as plain data."""
    from rayload.integrations.vllm import last_load

    load = last_load()
    return {
        "params": {n: p.detach().clone().cpu() for n, p in model.named_parameters()},
        "load": None
        if load is None
        else {
            "rank": load.rank,
            "tp_size": load.tp_size,
            "shard_bytes": load.shard_bytes,
            "read_chars": load.read_chars,
            "bytes_read": load.report.bytes_read,
            "method": load.report.method.effective.value,
            "phases": [dataclasses.astuple(p)[:3] for p in load.report.phases],
        },
    }


def run(checkpoint: str, tp: int, load_format: str, **engine: Any) -> dict[str, Any]:
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=checkpoint,
        load_format=load_format,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
        **engine,
    )
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
            for o in outputs
        ],
        "workers": llm.apply_model(_worker_state),
        "startup_s": startup_s,
    }
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return result


def main() -> None:
    checkpoint, tp, out, *loaders = sys.argv[1:]
    results = {loader: run(checkpoint, int(tp), loader) for loader in loaders}
    with open(out, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()
