"""examples/serve_vllm.py under Ray Serve (issue #23, step 5): one replica running vLLM,
loaded with ``load_format="rayload"``, at TP 1 (the engine in the replica's process, its
core in a process of its own) and at TP 2 (through vLLM's mp executor: two worker
processes on the replica's node).

``POST /`` answers the greedy continuation. The same engine then reloads its weights in
place with vLLM's own loader (``load_format="auto"``): first from a checkpoint with every
tensor changed, which must change the answers (so the reload does reach the weights the
engine computes with), then from the served checkpoint, which must give back rayload's
answers id for id. The workers' rayload spans are merged into ``trace_dir``: one trace,
rank 0's ``rayload.load`` the parent of every worker's ``rank.load`` (no vLLM tracing
here: the trace id is rank 0's, broadcast over the TP group).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# vllm.model_executor, not vllm: tests/vllm itself imports as a namespace package `vllm`.
pytest.importorskip(
    "vllm.model_executor", reason="vLLM is in the vLLM test environment (.venv-vllm) only"
)
pytest.importorskip("ray.serve", reason="Ray Serve (ray[serve]) is not installed")

import ray
from ray import serve
from safetensors.torch import load_file

from rayload.tracing import schema

pytestmark = [pytest.mark.slow, pytest.mark.ray]

HERE = Path(__file__).parent
EXAMPLE = HERE.parents[1] / "examples" / "serve_vllm.py"
PROMPTS = ([1, 2, 3, 4, 5], [17, 9, 101, 42], [150, 7, 7, 7, 7, 7, 60, 3])


def _by_path(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Served:
    url: str
    handle: Any
    checkpoint: Path
    rolled: Path
    tensors: int
    trace_dir: Path
    tp: int

    def post(self, body: bytes) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(self.url, data=body), timeout=120
            ) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def answers(self) -> list[list[int]]:
        answers = []
        for ids in PROMPTS:
            status, body = self.post(json.dumps({"token_ids": list(ids)}).encode())
            assert status == 200, body
            answers.append(json.loads(body)["token_ids"])
        return answers


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    tp: int = request.param
    example = _by_path("rayload_serve_vllm_example", EXAMPLE)
    checkpoints = _by_path("rayload_tests_vllm_checkpoints", HERE / "checkpoints.py")
    tmp = tmp_path_factory.mktemp("serve-vllm")
    checkpoint = checkpoints.write_llama_gqa(tmp / "llama")
    rolled = checkpoints.write_changed(checkpoint, tmp / "llama-changed")
    tensors = len(load_file(checkpoint / "model.safetensors"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rayload-vllm")
    ray.cloudpickle.register_pickle_by_value(example)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        # No OTLP endpoint: the workers' spans go to trace_dir only.
        env = {**example.cpu_env(tp), "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
               "OTEL_EXPORTER_OTLP_ENDPOINT": ""}  # fmt: skip
        app = example.VllmServer.options(
            ray_actor_options={"num_cpus": 0.5, "runtime_env": {"env_vars": env}}
        ).bind(
            model=str(checkpoint),
            tensor_parallel_size=tp,
            max_tokens=6,
            engine_args={
                "dtype": "float32",
                "enforce_eager": True,
                "max_model_len": 64,
                "max_num_seqs": 4,
                "seed": 0,
                "model_loader_extra_config": {"trace_dir": str(tmp / "trace")},
            },
        )
        handle: Any = serve.run(app, name="rayload-vllm", route_prefix="/")
        yield Served(
            f"http://127.0.0.1:{port}/", handle, checkpoint, rolled, tensors, tmp / "trace", tp
        )
    finally:
        serve.shutdown()
        ray.shutdown()


def test_rayload_answers_equal_vllms_own_loader_in_the_same_engine(served: Served) -> None:
    rayload_answers = served.answers()
    assert all(len(a) == 6 for a in rayload_answers)

    read = served.handle.reload_weights.remote("auto", str(served.rolled)).result()
    assert read == [served.tensors] * served.tp
    assert served.answers() != rayload_answers  # the reload reaches the engine's weights

    read = served.handle.reload_weights.remote("auto").result()
    assert read == [served.tensors] * served.tp
    assert served.answers() == rayload_answers


def test_a_body_without_token_ids_is_a_400_with_its_reason(served: Served) -> None:
    status, body = served.post(b'{"ids": [1]}')
    assert status == 400 and body.count("\n") == 1 and "token_ids" in body
    status, body = served.post(b"[1, 2")
    assert status == 400 and "not JSON" in body


def test_every_workers_spans_are_one_trace_under_rank_0s_root(served: Served) -> None:
    otlp = json.loads((served.trace_dir / "trace.otlp.json").read_text())
    spans = [
        (resource.get("resource", {}), span)
        for resource in otlp["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]
    (root,) = [s for _, s in spans if s["name"] == schema.ROOT_SPAN]
    rank_loads = [(r, s) for r, s in spans if s["name"] == schema.RANK_SPAN]
    assert len({s["traceId"] for _, s in spans}) == 1
    assert "parentSpanId" not in root or not root["parentSpanId"]
    assert sorted(_rank(r) for r, _ in rank_loads) == list(range(served.tp))
    assert {s["parentSpanId"] for _, s in rank_loads} == {root["spanId"]}


def _rank(resource: dict[str, Any]) -> int:
    """The ``rayload.rank`` of a resource in OTLP JSON."""
    values = {a["key"]: a["value"] for a in resource.get("attributes", [])}
    value = values[schema.RANK]
    return int(value.get("intValue", value.get("stringValue")))
