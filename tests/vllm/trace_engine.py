"""Starts one vLLM engine with ``load_format="rayload"`` and tracing on, generates, stops:
``python trace_engine.py CHECKPOINT TP OTLP_ENDPOINT TRACE_DIR OUT``.

vLLM traces its start-up to ``OTLP_ENDPOINT`` (``otlp_traces_endpoint``) and rayload's
workers put their spans beside vLLM's and into ``TRACE_DIR``; ``OUT`` gets the greedy
tokens of one prompt (JSON). Run in a fresh process: vLLM's tracer provider is global.

The engine core runs in its own process, as ``vllm serve`` and ``LLM`` run it by default
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``, whatever the caller's environment says: the other
tests/vllm modules run their cores in-process). That is the start-up vLLM traces as one
trace, under "SyncMPClient init". vLLM 0.32's in-process core (``InprocClient``) has no
span around its start-up: "Executor init" (the workers' spans, rayload's among them) and
"Prepare model" are two roots, of two traces.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    checkpoint, tp, endpoint, trace_dir, out = sys.argv[1:]
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=checkpoint,
        load_format="rayload",
        model_loader_extra_config={"trace_dir": trace_dir},
        otlp_traces_endpoint=endpoint,
        tensor_parallel_size=int(tp),
        distributed_executor_backend="mp" if int(tp) > 1 else None,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=2,
        seed=0,
        # vLLM 0.32 traces each request too, and asserts on the request's stats when they
        # are off (LLM's default): "assert req_state.stats is not None".
        disable_log_stats=False,
    )
    outputs = llm.generate(
        [{"prompt_token_ids": [1, 2, 3, 4, 5]}],
        SamplingParams(temperature=0.0, max_tokens=4),
    )
    with open(out, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outputs], f)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    main()
