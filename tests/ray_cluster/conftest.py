"""One real local Ray cluster for every test under tests/ray_cluster, plus leak checks.

The cluster is package-scoped (this directory is a package for that reason): it is shut
down after the last test here, so test packages that run later start without Ray.

The cluster has 2 CPUs and 4 *fake* GPUs (``num_gpus=4``): Ray schedules GPU bundles and
sets ``CUDA_VISIBLE_DEVICES`` per actor as on a GPU node, while torch (CPU build) sees no
CUDA, so ``device="auto"`` resolves to ``cpu``. The dashboard is on (on a free port)
because the state API (``ray.util.state``) that the leak checks use goes through it.
Tests that need their own cluster (several nodes, ``ray start``) run it in a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import ray
from ray.util.state import list_actors

import rayload
from rayload.actors.directory import DIRECTORY_NAME

FAKE_GPUS = 4


def _tracing_receivers() -> Any:
    """tests/tracing/receivers.py (real OTLP receivers), loaded by path: test modules cannot
    import each other under ``--import-mode=importlib``."""
    name = "rayload_tests_tracing_receivers"
    if name not in sys.modules:
        source = Path(__file__).parents[1] / "tracing" / "receivers.py"
        spec = importlib.util.spec_from_file_location(name, source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


otlp_http_receiver = _tracing_receivers().otlp_http_receiver
otlp_grpc_receiver = _tracing_receivers().otlp_grpc_receiver
black_hole = _tracing_receivers().black_hole


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class RayCluster:
    """The session's cluster. Pass ``state_address`` to ``ray.util.state`` calls: without
    it they guess, and fail when other Ray clusters run on the machine."""

    state_address: str
    node_id: str


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[RayCluster]:
    context = ray.init(
        address="local",
        num_cpus=2,
        num_gpus=FAKE_GPUS,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=free_port(),
        log_to_driver=False,
        logging_level=logging.ERROR,
        namespace="rayload-tests",
    )
    yield RayCluster(
        state_address=f"http://{context.dashboard_url}",
        node_id=ray.get_runtime_context().get_node_id(),
    )
    ray.shutdown()


@dataclass(frozen=True)
class ClusterState:
    """What a test could leak: alive actors and created placement groups."""

    actors: frozenset[str]
    groups: frozenset[str]

    @classmethod
    def now(cls, state_address: str) -> ClusterState:
        alive = list_actors(
            address=state_address,
            filters=[("state", "=", "ALIVE")],
            raise_on_missing_output=False,
        )
        groups = ray.util.placement_group_table()
        return cls(
            # The peer directory is the one actor meant to outlive loads (until
            # `rayload directory --stop`); tests/ray_cluster/test_peers.py checks it.
            actors=frozenset(a.actor_id for a in alive if a.name != DIRECTORY_NAME),
            groups=frozenset(g for g, info in groups.items() if info["state"] == "CREATED"),
        )


@pytest.fixture
def no_leaks(ray_cluster: RayCluster) -> Iterator[ClusterState]:
    """Assert the test left no alive actor and no created placement group behind.

    ``ray.kill`` and ``remove_placement_group`` are asynchronous in the GCS, so the check
    polls for a short while before it fails."""
    before = ClusterState.now(ray_cluster.state_address)
    yield before
    _assert_no_leaks(ray_cluster, before)


def _assert_no_leaks(ray_cluster: RayCluster, before: ClusterState) -> None:
    after = ClusterState.now(ray_cluster.state_address)
    for _ in range(50):
        if after.actors <= before.actors and after.groups <= before.groups:
            break
        time.sleep(0.2)
        after = ClusterState.now(ray_cluster.state_address)
    assert after.actors <= before.actors, f"leaked actors: {after.actors - before.actors}"
    assert after.groups <= before.groups, f"leaked placement groups: {after.groups - before.groups}"


@dataclass(frozen=True)
class SpanView:
    """One span of a written ``trace.otlp.json``, flattened for assertions."""

    name: str
    rank: int | None
    error: bool
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any] = field(default_factory=dict)


def _otlp_value(value: dict[str, Any]) -> Any:
    (kind, raw), *_ = value.items()
    return int(raw) if kind == "intValue" else raw


def read_trace(trace_dir: Path) -> list[SpanView]:
    """Every span of ``trace_dir/trace.otlp.json`` (OTLP JSON as rayload writes it)."""
    data = json.loads((trace_dir / "trace.otlp.json").read_text())
    views = []
    for resource_spans in data["resourceSpans"]:
        resource = {
            a["key"]: _otlp_value(a["value"])
            for a in resource_spans.get("resource", {}).get("attributes", [])
        }
        for scope in resource_spans["scopeSpans"]:
            for span in scope["spans"]:
                attrs = {a["key"]: _otlp_value(a["value"]) for a in span.get("attributes", [])}
                views.append(
                    SpanView(
                        name=span["name"],
                        rank=attrs.get("rayload.rank"),
                        error=span.get("status", {}).get("code") == 2,
                        start_ns=int(span["startTimeUnixNano"]),
                        end_ns=int(span["endTimeUnixNano"]),
                        attributes=attrs,
                        resource=resource,
                    )
                )
    return views


@pytest.fixture
def trace_reader() -> Callable[[Path], list[SpanView]]:
    return read_trace


SKEW_NS = 5_000_000_000
"""How far ahead rank 1's clock runs in ``skewed_load``."""


@dataclass(frozen=True)
class SkewedLoad:
    """One traced TP=2 ``scratch`` load of ``tiny_llama`` whose rank 1 clock runs
    ``SKEW_NS`` ahead: its spans and rank 1's own report."""

    spans: list[SpanView]
    rank_1: Any
    skew_ns: int = SKEW_NS


@pytest.fixture(scope="package")
def skewed_load(
    ray_cluster: RayCluster, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> SkewedLoad:
    """Shared by the trace tests (test_trace.py, test_spawn_spans.py) that read one load's
    trace: a load costs seconds of actor start-up, and the skew changes nothing they check
    but the clocks (which they check)."""
    trace_dir = tmp_path_factory.mktemp("skewed-trace")
    before = ClusterState.now(ray_cluster.state_address)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYLOAD_TEST_HOOKS", json.dumps({"clock_skew_ns": {"1": SKEW_NS}}))
        with rayload.load(tiny_llama, 2, method="scratch", device="cpu", trace_dir=trace_dir) as r:
            rank_1 = r.ranks[1]
    _assert_no_leaks(ray_cluster, before)
    return SkewedLoad(spans=read_trace(trace_dir), rank_1=rank_1)


@pytest.fixture
def set_test_hooks(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``set_test_hooks(fault={...}, clock_skew_ns={...})`` sets ``RAYLOAD_TEST_HOOKS`` for
    the loads of this test (see rayload.actors.hooks)."""

    def set_hooks(**hooks: Any) -> None:
        monkeypatch.setenv("RAYLOAD_TEST_HOOKS", json.dumps(hooks))

    return set_hooks


SERVE_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_deployment.py"


@pytest.fixture
def serve_example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/serve_deployment.py, imported from its path for this test only."""
    spec = importlib.util.spec_from_file_location("rayload_serve_example", SERVE_EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    # Workers cannot import a module loaded from a path: ship its code by value.
    ray.cloudpickle.register_pickle_by_value(module)
    return module


@dataclass(frozen=True)
class ServeInstance:
    """Ray Serve running on the session cluster, its HTTP proxy on ``port``."""

    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"


@pytest.fixture(scope="package")
def serve_instance(ray_cluster: RayCluster) -> Iterator[ServeInstance]:
    """Ray Serve, started once for every Serve test here (its controller and proxy take
    seconds to start and to stop) and shut down after the package's last test: the
    shutdown must leave no actor or placement group but those there before Serve started.
    Each test deletes the applications it ran (``serve.delete``), so what a deleted app
    leaves behind is the test's leak."""
    from ray import serve

    before = ClusterState.now(ray_cluster.state_address)
    instance = ServeInstance(port=free_port())
    serve.start(http_options={"host": "127.0.0.1", "port": instance.port})
    yield instance
    serve.shutdown()
    _assert_no_leaks(ray_cluster, before)


@pytest.fixture
def unused_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_port()
