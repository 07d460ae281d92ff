"""The Ray transport of the ``peer`` load method: a loaded rank exports its shards to Ray's
object store, and the same rank of another replica pulls them from there.

Holder side (:class:`ShardExport`, run by the rank actor in its ``peer`` concurrency group,
so it answers while the actor's main thread loads or runs engine code): once the rank's
load has finished, its tensors are put into the object store in chunks of about
:data:`CHUNK_BYTES` (one ``ray.put`` each, the rank actor is their owner) and the chunks'
refs are handed to every receiver that asks. Receivers on other nodes pull the chunks
through Ray's object manager, from any node that already holds a copy; receivers on the
holder's node read them from shared memory. The export is kept while receivers use it
and dropped when the last says it is done.

Receiver side (:class:`RayPeerSource`, a :class:`~rayload.loading.peer.PeerSource`): asks
the holder for its export (waiting, within the load's time, while a holder that is itself
loading finishes), checks that the holder has exactly the shards of the receiver's plan,
then yields each tensor's bytes chunk by chunk. Anything Ray raises (the holder's actor
died, its objects were lost with it, a time-out) becomes
:class:`~rayload.loading.peer.PeerUnavailable`: the ``peer`` backend then reads storage
and reports the fallback.

Only CPU memory travels: a holder on a GPU copies each chunk to the host first (no NCCL
path yet).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError

from rayload.loading.peer import PeerUnavailable
from rayload.loading.plan import RankPlan

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
"""About how many bytes of tensors one object of an export holds (a larger tensor is an
object of its own): few enough objects for thousands of tensors, small enough that pulls
from several holders overlap."""

PEER_GROUP = "peer"
"""The rank actor's concurrency group for the peer methods (export, its release, ping)."""

PEER_CONCURRENCY = 4
"""Peer calls a rank actor serves at once."""

_GET_TIMEOUT_S = 120.0
"""The longest a receiver waits for one chunk of a holder that has finished loading."""


@dataclass(frozen=True)
class PeerRef:
    """Where a rank gets its shards from: rank ``rank`` of replica ``replica``, whose actor
    is ``actor``, on node ``node_id``. ``loading`` says the holder had not finished its
    own load when it was chosen (the receiver then waits for it)."""

    replica: str
    rank: int
    node_id: str | None
    actor: Any
    loading: bool = False

    def describe(self) -> str:
        node = (self.node_id or "unknown")[:12]
        return f"replica {self.replica} rank {self.rank} on node {node}"


@dataclass(frozen=True)
class PeerExport:
    """What a holder hands a receiver: its identity, each tensor's byte count, and the
    chunks (``refs[i]`` holds the tensors ``names[i]``, in that order, as 1-D uint8
    arrays)."""

    replica: str
    rank: int
    node_id: str | None
    nbytes: Mapping[str, int]
    names: tuple[tuple[str, ...], ...]
    refs: tuple[Any, ...]


class ShardExport:
    """A holder rank's export state: waits for the load, builds the export once, counts
    the receivers using it. Thread-safe (the actor's peer methods run in a thread pool)."""

    def __init__(self, *, chunk_bytes: int | None = None) -> None:
        self._chunk_bytes = chunk_bytes or CHUNK_BYTES
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._tensors: Mapping[str, torch.Tensor] | None = None
        self._failure: str | None = None
        self._export: PeerExport | None = None
        self._users = 0
        self.served = 0

    def loading(self) -> None:
        """The rank's tensors are being (re)written: receivers wait; an old export goes."""
        with self._lock:
            self._settled.clear()
            self._tensors, self._export, self._failure = None, None, None

    def loaded(self, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            self._tensors, self._failure = tensors, None
            self._settled.set()

    def failed(self, why: str) -> None:
        with self._lock:
            self._tensors, self._failure = None, why
            self._settled.set()

    def export(self, replica: str, rank: int, node_id: str | None, wait_s: float) -> PeerExport:
        """The export, built on first use, once the load has finished (at most ``wait_s``
        seconds of waiting). Raises RuntimeError when the load failed or is still running."""
        if not self._settled.wait(max(wait_s, 0.0)):
            raise RuntimeError(f"it was still loading after {wait_s:.0f} s")
        with self._lock:
            if self._tensors is None:
                raise RuntimeError(f"its own load failed: {self._failure or 'no weights'}")
            if self._export is None:
                self._export = _put_chunks(replica, rank, node_id, self._tensors, self._chunk_bytes)
            self._users += 1
            self.served += 1
            return self._export

    def release(self) -> None:
        """A receiver is done: the last one lets the export's objects go."""
        with self._lock:
            self._users = max(self._users - 1, 0)
            if self._users == 0:
                self._export = None


def _put_chunks(
    replica: str,
    rank: int,
    node_id: str | None,
    tensors: Mapping[str, torch.Tensor],
    chunk_bytes: int,
) -> PeerExport:
    names: list[tuple[str, ...]] = []
    refs: list[Any] = []
    batch: list[str] = []
    arrays: list[Any] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if batch:
            names.append(tuple(batch))
            refs.append(ray.put(arrays.copy()))
            batch.clear()
            arrays.clear()
            size = 0

    for name, tensor in tensors.items():
        data = tensor.detach()
        if data.device.type != "cpu":
            data = data.to("cpu")
        flat = data.contiguous().reshape(-1).view(torch.uint8)
        if batch and size + flat.numel() > chunk_bytes:
            flush()
        batch.append(name)
        arrays.append(flat.numpy())
        size += flat.numel()
    flush()
    return PeerExport(
        replica=replica,
        rank=rank,
        node_id=node_id,
        nbytes={name: t.numel() * t.element_size() for name, t in tensors.items()},
        names=tuple(names),
        refs=tuple(refs),
    )


class RayPeerSource:
    """A :class:`~rayload.loading.peer.PeerSource` over Ray: the holder ``ref`` exports, the
    receiver pulls. ``wait_s`` bounds the wait for a holder that is still loading;
    ``pause_s`` (a TEST HOOK) pauses after the first chunk, so a test can stop the holder
    mid-transfer."""

    def __init__(self, ref: PeerRef, *, wait_s: float, pause_s: float = 0.0) -> None:
        self.ref = ref
        self.replica = ref.replica
        self.rank = ref.rank
        self.node_id = ref.node_id
        self._wait_s = wait_s
        self._pause_s = pause_s

    def describe(self) -> str:
        return self.ref.describe()

    def fetch(self, plan: RankPlan) -> Iterator[tuple[str, Any]]:
        export = self._export()
        try:
            want = {shard.name: shard.nbytes for shard in plan.shards}
            if dict(export.nbytes) != want:
                raise PeerUnavailable(_plan_difference(export.nbytes, want))
            for i, (names, chunk) in enumerate(zip(export.names, export.refs, strict=True)):
                arrays = _get(chunk, _GET_TIMEOUT_S, "a chunk of its shards")
                yield from zip(names, arrays, strict=True)
                del arrays
                if i == 0 and self._pause_s > 0:
                    time.sleep(self._pause_s)
        finally:
            try:
                self.ref.actor.release_export.remote()
            except RayError as exc:  # the holder is gone: nothing to release
                log.debug("could not release the export of %s: %s", self.describe(), exc)

    def _export(self) -> PeerExport:
        ref = self.ref.actor.export.remote(self._wait_s)
        export: PeerExport = _get(ref, self._wait_s + _GET_TIMEOUT_S, "its export")
        return export


def _get(ref: Any, timeout_s: float, what: str) -> Any:
    """``ray.get`` with Ray's failures as PeerUnavailable naming ``what`` was asked."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError as exc:
        raise PeerUnavailable(f"no answer for {what} within {timeout_s:.0f} s") from exc
    except RayError as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise PeerUnavailable(f"{type(exc).__name__} while getting {what}: {first}") from exc


def _plan_difference(have: Mapping[str, int], want: Mapping[str, int]) -> str:
    missing = sorted(want.keys() - have.keys())
    extra = sorted(have.keys() - want.keys())
    if missing:
        return f"it holds no tensor {missing[0]!r} ({len(missing)} missing): its plan differs"
    if extra:
        return f"it holds tensor {extra[0]!r}, which this rank's plan lacks: its plan differs"
    name = next(n for n in want if have[n] != want[n])
    return f"its tensor {name!r} has {have[name]} bytes, this rank's shard {want[name]}"
