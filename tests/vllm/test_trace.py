"""One trace across a vLLM engine's workers (issue #23, step 4): one TP 2 engine with
``load_format="rayload"``, vLLM tracing its start-up to a real OTLP/gRPC receiver
(``otlp_traces_endpoint``) and rayload's ``trace_dir`` in ``model_loader_extra_config``.

Every span the receiver gets, vLLM's and rayload's, is of one trace; each worker's
``rank.load`` (rayload's own span names) is a child of that worker's vLLM "Load model",
its phases are its children, vLLM's start-up phases are there by name, and the trace
files hold both workers' spans, merged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# vllm.model_executor, not vllm: tests/vllm itself imports as a namespace package `vllm`.
pytest.importorskip(
    "vllm.model_executor", reason="vLLM is in the vLLM test environment (.venv-vllm) only"
)

from opentelemetry.sdk.trace import ReadableSpan

from rayload.integrations.vllm import DESTINATIONS_PHASE
from rayload.loading.model import MODEL_BUILD_PHASE
from rayload.loading.report import PHASES, PLAN, RESOLVE
from rayload.tracing import schema

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
TP = 2
RANK_PHASES = [MODEL_BUILD_PHASE, RESOLVE, PLAN, DESTINATIONS_PHASE, *PHASES]
"""A worker's phases in order: vLLM builds the model; rayload opens and plans the
checkpoint, finds where each tensor lands (the dry run), then loads every tensor straight
into its parameter (its own ``rank.resolve`` ... ``rank.post_load``). No tensor goes
through vLLM's weight loaders, so there is no ``rank.model.fill``."""
REQUEST_SPAN = "llm_request"
VLLM_PHASES = {
    "Worker init": "a worker's start",
    "Loading (CPU)": "the model runner's load",
    "Load model": "the loader's load_model (weight load)",
    "Initialize model": "model init",
    "Prepare model": "the engine's KV-cache profiling, allocation and warm-up",
}


def _by_path(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Traced:
    spans: list[ReadableSpan]
    trace_dir: Path
    tokens: list[list[int]]

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name == name]

    def by_id(self) -> dict[int, ReadableSpan]:
        return {s.context.span_id: s for s in self.spans if s.context is not None}


def _rank(span: ReadableSpan) -> int:
    return int(span.resource.attributes[schema.RANK])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    receivers = _by_path("rayload_tests_vllm_receivers", HERE.parent / "tracing" / "receivers.py")
    checkpoints = _by_path("rayload_tests_vllm_checkpoints", HERE / "checkpoints.py")
    tmp = tmp_path_factory.mktemp("vllm-trace")
    checkpoint = checkpoints.write_llama_gqa(tmp / "llama")
    receiver = receivers.GrpcReceiver()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        subprocess.run(
            [sys.executable, str(HERE / "trace_engine.py"), str(checkpoint), str(TP),
             receiver.endpoint, str(tmp / "trace"), str(tmp / "tokens.json")],
            env=env, check=True, timeout=600,
        )  # fmt: skip
        # vLLM's processes export in batches, every 5 s and at exit; rayload's as each
        # worker's load ends: wait until every process's spans are in.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            names = [s.name for s in receiver.spans()]
            if names.count("Load model") == TP and "Prepare model" in names:
                break
            time.sleep(0.5)
        yield Traced(receiver.spans(), tmp / "trace", json.loads((tmp / "tokens.json").read_text()))
    finally:
        receiver.stop()


def test_the_engine_generates_with_tracing_on(traced: Traced) -> None:
    assert [len(t) for t in traced.tokens] == [4]


def test_every_startup_span_of_vllm_and_rayload_is_one_trace(traced: Traced) -> None:
    rank_loads = traced.named(schema.RANK_SPAN)
    assert sorted(_rank(s) for s in rank_loads) == list(range(TP))
    # vLLM traces each request on its own ("llm_request", a trace per request).
    startup = [s for s in traced.spans if s.name != REQUEST_SPAN]
    assert len(traced.named(REQUEST_SPAN)) == 1
    assert {s.context.trace_id for s in startup if s.context} == {rank_loads[0].context.trace_id}
    assert [s.name for s in startup if s.parent is None] == ["SyncMPClient init"]
    # Unique span ids (vLLM seeds every worker's `random` alike; rayload gives vLLM's
    # tracer provider secure ids, or the workers' "Load model" spans would share one).
    span_ids = [s.context.span_id for s in traced.spans if s.context]
    assert len(span_ids) == len(set(span_ids))


def test_each_rank_load_is_a_child_of_its_workers_load_model(traced: Traced) -> None:
    by_id = traced.by_id()
    for rank_load in traced.named(schema.RANK_SPAN):
        assert rank_load.parent is not None
        load_model = by_id[rank_load.parent.span_id]
        assert load_model.name == "Load model"
        assert load_model.resource.attributes["vllm.process_name"] == f"Worker_{_rank(rank_load)}"
        assert rank_load.resource.attributes["service.name"] == schema.RANK_SERVICE
        attributes = rank_load.attributes or {}
        assert attributes[schema.TP_SIZE] == TP and attributes["rayload.engine"] == "vllm"
        assert attributes[schema.METHOD_EFFECTIVE] in {"scratch", "fastsafetensors"}
        assert int(attributes[schema.BYTES]) > 0  # type: ignore[arg-type]
        # vLLM's own chain up to the engine's root, in the same trace.
        chain, span = [], load_model
        while span.parent is not None:
            span = by_id[span.parent.span_id]
            chain.append(span.name)
        assert chain[0] == "Loading (CPU)" and chain[-1] == "SyncMPClient init"
        assert "Executor init" in chain and "EngineCoreProc init" in chain


def test_each_rank_loads_phases_are_its_children_in_time(traced: Traced) -> None:
    for rank_load in traced.named(schema.RANK_SPAN):
        children = [
            s for s in traced.spans
            if s.parent is not None and s.parent.span_id == rank_load.context.span_id
        ]  # fmt: skip
        assert all(_rank(c) == _rank(rank_load) for c in children)
        assert all(
            rank_load.start_time <= c.start_time <= c.end_time <= rank_load.end_time  # type: ignore[operator]
            for c in children
        )
        order = [c.name for c in sorted(children, key=lambda c: c.start_time or 0)]
        assert order == RANK_PHASES


def test_vllms_startup_phases_are_named_in_the_trace(traced: Traced) -> None:
    names = [s.name for s in traced.spans]
    missing = {n: what for n, what in VLLM_PHASES.items() if n not in names}
    assert missing == {}
    assert names.count("Load model") == names.count("Initialize model") == TP


def test_the_trace_files_merge_both_workers(traced: Traced) -> None:
    otlp = json.loads((traced.trace_dir / "trace.otlp.json").read_text())
    spans = [
        span
        for resource in otlp["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]
    rank_loads = [s for s in spans if s["name"] == schema.RANK_SPAN]
    received = traced.named(schema.RANK_SPAN)[0].context
    assert len(rank_loads) == TP
    assert {s["traceId"] for s in spans} == {f"{received.trace_id:032x}"}
    assert len(spans) == TP * (1 + len(RANK_PHASES))
    for name in ("trace.jaeger.json", "trace.chrome.json", "trace.html"):
        assert (traced.trace_dir / name).stat().st_size > 0
    assert not list(traced.trace_dir.glob("*.part"))
