"""What the peer benchmark runs on: a ``ray.cluster_utils.Cluster`` of several nodes on
one machine, a checkpoint whose shards the scratch reader reads exactly, and loads pinned
to one node.

Every node of the cluster is a raylet with its own object store, so a pull between two
of them goes through Ray's object manager (over loopback here), as between machines;
only the disk and the CPUs are shared. Worker node ``i`` has the custom resource
``peerbench_node_<i>``, which :class:`PinnedLoader` uses to run a ``rayload.load`` whose
ranks are on that node (the way a Serve replica loads: its ranks take bundles 1..tp of
the caller's placement group).

The exact-read checkpoint: rayload's scratch reader reads split-1 rows closer than
:data:`~rayload.loading.reader.reads.GATHER_GAP` apart as whole runs, gaps included
(every page holds row bytes, so the disk reads them anyway), so on a small-hidden model
one replica reads ~1.3x its shards. With hidden and intermediate 2048 in f32 every split-1
gap at TP 2 is 4 KiB: each rank reads exactly its shard, and "read once per cluster" can
be checked against the checkpoint's own bytes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray

from rayload.loading.checkpoint import CONFIG_NAME, INDEX_NAME
from rayload.loading.synthetic import LlamaShape

log = logging.getLogger(__name__)

NODE_RESOURCE = "peerbench_node_"
"""Prefix of the custom resource that names worker node ``i`` (``peerbench_node_<i>``)."""

ROOM_CPUS = 0.025
"""Logical CPUs left free on each worker node: room for one replica of TP 2 at rayload's
0.01 CPU per rank and no second one, so Ray must put the replicas of one load on
different nodes (with whole CPUs free it packed two on one node in run
``bench-2026-12-02T003221``). Ray wants whole CPUs per node, so each node has 1 and a
placement group holds the rest (:func:`local_cluster`). Logical only: Ray does not cap
real CPU use."""

PINNED_BUNDLE_CPUS = 0.004
"""CPU of each bundle of a :func:`pinned_loader` group: two such loads (holder and
receiver) fit on one node."""

EXACT_SHAPE = LlamaShape(
    vocab_size=1024,
    hidden_size=2048,
    intermediate_size=2048,
    num_hidden_layers=1,
    num_attention_heads=16,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
"""A Llama whose split-1 rows at TP 2 are 4 KiB apart in f32 (o_proj and down_proj rows of
8 KiB, half each rank's): the scratch reader reads exactly each rank's shards."""

_F32 = 4


def exact_shape(size_gb: float) -> LlamaShape:
    """:data:`EXACT_SHAPE` with layers and vocabulary scaled to about ``size_gb`` GB (f32):
    as many whole layers as fit beside a 1024-entry vocabulary, the rest vocabulary."""
    target = size_gb * 1e9
    fixed = _nbytes(replace(EXACT_SHAPE, num_hidden_layers=0))
    per_layer = _nbytes(EXACT_SHAPE) - fixed
    layers = max(1, int((target - fixed) // per_layer))
    rest = target - _nbytes(replace(EXACT_SHAPE, num_hidden_layers=layers, vocab_size=0))
    per_token = 2 * EXACT_SHAPE.hidden_size * _F32  # embedding and lm_head rows
    vocab = max(128, int(rest // per_token) // 128 * 128)
    return replace(EXACT_SHAPE, num_hidden_layers=layers, vocab_size=vocab)


def _nbytes(shape: LlamaShape) -> int:
    return sum(math.prod(dims) for _, dims in shape.tensors()) * _F32


def write_exact_checkpoint(out: str | os.PathLike[str], *, size_gb: float, seed: int = 0) -> Path:
    """Write an f32 checkpoint of :func:`exact_shape` into ``out`` (two files, Hugging Face
    index layout, seeded random normal values) unless one is there; return its path."""
    import torch
    from safetensors.torch import save_file

    root = Path(out)
    if (root / INDEX_NAME).exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    shape = exact_shape(size_gb)
    tensors = shape.tensors()
    total = _nbytes(shape)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    files: list[dict[str, torch.Tensor]] = [{}, {}]
    written = 0
    for name, dims in tensors:
        part = 0 if written < total / 2 else 1
        files[part][name] = torch.randn(dims, generator=generator, dtype=torch.float32)
        weight_map[name] = f"model-0000{part + 1}-of-00002.safetensors"
        written += math.prod(dims) * _F32
    for part, batch in enumerate(files):
        name = f"model-0000{part + 1}-of-00002.safetensors"
        save_file(batch, str(root / name), metadata={"format": "pt"})
    (root / CONFIG_NAME).write_text(json.dumps(shape.config("F32"), indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return root


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    """The checkpoint's tensor files (what a cold load reads from the disk)."""
    return sorted(str(p) for p in Path(path).glob("*.safetensors"))


@dataclass(frozen=True)
class LocalCluster:
    """The running ``ray.cluster_utils.Cluster`` and the ids of the placement groups that
    hold each worker node's CPUs beyond :data:`ROOM_CPUS`."""

    cluster: Any
    reserved: tuple[str, ...]


@contextmanager
def local_cluster(nodes: int, *, object_store_bytes: int = 1 << 30) -> Iterator[LocalCluster]:
    """A head without CPUs (nothing is scheduled on it) and ``nodes`` worker nodes, each
    with :data:`ROOM_CPUS` logical CPUs free (room for one TP=2 replica; a placement group
    per node, listed in :attr:`LocalCluster.reserved`, holds the rest of its 1 CPU), its
    own object store and resource ``peerbench_node_<i>``; this process connected to it.
    Shut down (directory included) on exit."""
    from ray.cluster_utils import Cluster

    from rayload.actors.directory import stop_directory

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "object_store_memory": 200 << 20},
    )
    try:
        for i in range(nodes):
            cluster.add_node(
                num_cpus=1,
                object_store_memory=object_store_bytes,
                resources={f"{NODE_RESOURCE}{i}": 1},
            )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
        reserved = tuple(_reserve(i, 1 - ROOM_CPUS) for i in range(nodes))
        yield LocalCluster(cluster, reserved)
    finally:
        if ray.is_initialized():
            stop_directory()
            ray.shutdown()
        cluster.shutdown()


def _reserve(node: int, cpus: float) -> str:
    """Hold ``cpus`` logical CPUs of worker node ``node`` (a placement group); its id."""
    from ray.util.placement_group import placement_group

    group = placement_group([{"CPU": cpus, f"{NODE_RESOURCE}{node}": 0.001}])
    ray.get(group.ready(), timeout=60)
    return str(group.id.hex())


def worker_nodes() -> list[str]:
    """Worker node ids by index ``i`` (their ``peerbench_node_<i>`` resource)."""
    found: dict[int, str] = {}
    for node in ray.nodes():
        for key in node.get("Resources", {}):
            if key.startswith(NODE_RESOURCE) and node.get("Alive"):
                found[int(key[len(NODE_RESOURCE) :])] = node["NodeID"]
    return [found[i] for i in sorted(found)]


class PinnedLoader:
    """A driver of one ``rayload.load`` inside a placement group on one node: its ranks
    take bundles 1..tp of that group, so they run where the group is (as in Serve)."""

    def __init__(self) -> None:
        self._result: Any = None

    def load(
        self, path: str, tp: int, method: str, trace_dir: str, shared_copy: bool = False
    ) -> dict[str, Any]:
        import rayload

        start = time.perf_counter()
        self._result = rayload.load(
            path, tp, method=method, device="cpu", trace_dir=trace_dir, shared_copy=shared_copy
        )
        wall = time.perf_counter() - start
        return {"wall_s": wall, "ranks": [r.to_dict() for r in self._result.ranks]}

    def wait_shared_copy(self, timeout_s: float = 120.0) -> float:
        """Seconds until every rank's shared copy is in the object store (after a load
        with ``shared_copy``, which puts it in the background)."""
        start = time.perf_counter()
        wants = [{s.name: s.nbytes for s in r.shards} for r in self._result.plan.ranks]
        while not all(
            ray.get(a.shared_copy.remote(w))
            for a, w in zip(self._result.actors, wants, strict=True)
        ):
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"no shared copy after {timeout_s:.0f} s")
            time.sleep(0.02)
        return time.perf_counter() - start

    def close(self) -> None:
        if self._result is not None:
            self._result.close()
            self._result = None


_RemoteLoader: Any = ray.remote(num_cpus=0)(PinnedLoader)


@contextmanager
def pinned_loader(node: int, tp: int) -> Iterator[Any]:
    """A :class:`PinnedLoader` in a STRICT_PACK group of ``tp + 1`` bundles on worker
    node ``node``; its load is closed and the group removed on exit."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": PINNED_BUNDLE_CPUS, f"{NODE_RESOURCE}{node}": 0.01}
    group = placement_group([dict(bundle) for _ in range(tp + 1)], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=120)
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=group,
        placement_group_bundle_index=0,
        placement_group_capture_child_tasks=False,
    )
    loader = _RemoteLoader.options(
        scheduling_strategy=strategy, num_cpus=PINNED_BUNDLE_CPUS
    ).remote()
    try:
        yield loader
    finally:
        try:
            ray.get(loader.close.remote(), timeout=60)
        finally:
            ray.kill(loader)
            remove_placement_group(group)


class _Holder:
    """Holds one tensor and sends it over rayload's peer channel, or receives one: the
    transfer probe (:mod:`rayload.actors.peers`, the transport the ``peer`` method uses)."""

    def ready(self) -> bool:
        return True

    def hold(self, nbytes: int) -> None:
        import torch

        from rayload.actors.peers import ShardServer

        self._server = ShardServer()
        self._server.loaded({"probe": torch.randint(0, 255, (nbytes,), dtype=torch.uint8)})
        self._nbytes = nbytes

    def open_channel(self) -> Any:
        return self._server.open(ray.util.get_node_ip_address(), 0.0, {"probe": self._nbytes})

    def get(self, channel: Any) -> tuple[float, float]:
        """Receive the tensor into new memory, as a receiving rank does; the wall-clock
        start and end (s)."""
        import torch

        from rayload.actors.peers import receive

        start = time.time()
        into = {"probe": torch.empty(channel.sizes[0], dtype=torch.uint8)}
        for _ in receive(channel, ray.util.get_node_ip_address(), into):
            pass
        end = time.time()
        del into
        return start, end


_RemoteHolder: Any = ray.remote(num_cpus=0)(_Holder)


def transfer_rates(nbytes: int = 128 << 20, *, pulls: int = 3) -> dict[str, float]:
    """rayload's peer channel in this cluster, measured now (MB/s, received into new
    memory, timed inside the receiving actors, which are started before): one ``nbytes``
    tensor held on node 0 and received on node 0 (loopback), on node 1 (between nodes),
    and on nodes 2.. (up to ``pulls``) at once (aggregate: all bytes over first start to
    last end)."""

    def on(node: int) -> Any:
        return _RemoteHolder.options(resources={f"{NODE_RESOURCE}{node}": 0.001}).remote()

    available = len(worker_nodes())
    actors = [on(n) for n in range(min(available, 2 + pulls))]
    ray.get([a.ready.remote() for a in actors])
    holder = actors[0]
    ray.get(holder.hold.remote(nbytes))
    local = on(0)
    ray.get(local.ready.remote())

    def rate(receivers: list[Any]) -> float:
        channels = ray.get([holder.open_channel.remote() for _ in receivers])
        spans = ray.get([r.get.remote(c) for r, c in zip(receivers, channels, strict=True)])
        return len(spans) * nbytes / 1e6 / (max(e for _, e in spans) - min(s for s, _ in spans))

    rates: dict[str, float] = {}
    rates["same_node_MBps"] = rate([local])
    rates["cross_node_MBps"] = rate([actors[1]])
    many = actors[2:]
    if len(many) >= 2:
        rates["cross_node_at_once"] = len(many)
        rates["cross_node_aggregate_MBps"] = rate(many)
    for actor in (*actors, local):
        ray.kill(actor)
    return rates


def cold_read_rate(files: Sequence[str]) -> float:
    """MB/s of one sequential read of ``files`` from the disk (page cache dropped first)."""
    from rayload.benchmark.probes import evict

    evict(files)
    buf = memoryview(bytearray(16 << 20))
    total = 0
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total / 1e6 / (time.perf_counter() - start)
