"""The cluster's peer directory: which replicas hold which checkpoint, so a new replica can
load from one of them instead of from storage.

One named, detached Ray actor per cluster (:data:`DIRECTORY_NAME` in namespace
:data:`NAMESPACE`), created by the first load that asks for it and stopped by
``rayload directory --stop`` (:func:`stop_directory`). It maps a replica id to a
:class:`ReplicaEntry`: the checkpoint's peer key (identity and plan,
:func:`~rayload.loading.identity.peer_key`), its rank actors and their nodes, and whether
its load has finished. Its methods are quick and never call out, so one actor serves the
whole cluster.

Rules (docs/ray.md "Peer loading"):

* a load *claims* its key once its ranks are up: it is registered as ``loading`` and gets
  the replicas already registered for that key (loaded or still loading);
* the driver checks those holders are alive (one ping per rank actor, in the actors' peer
  concurrency group) and drops the dead from the directory: no stale holder is used;
* a load that finishes marks itself ``loaded``; a load that fails, and ``close()``, drop it;
* when the directory cannot be reached (killed, a lost head), a load reads storage and says
  so in a warning: the directory only ever saves reads, it is never needed to load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import ray
from ray.exceptions import GetTimeoutError, RayError

log = logging.getLogger(__name__)

DIRECTORY_NAME = "rayload-peer-directory"
NAMESPACE = "rayload"

CALL_TIMEOUT_S = 20.0
"""How long a load waits for the directory (its first use starts its worker process)."""

PING_TIMEOUT_S = 3.0
"""How long a holder's rank actor has to answer the liveness ping."""

State = Literal["loading", "loaded"]

_last_used: str | None = None
"""The actor id of the directory this process last used (None: none yet, or stopped)."""


@dataclass(frozen=True)
class ReplicaEntry:
    """One replica as the directory knows it.

    ``actors[r]``/``nodes[r]`` are rank ``r``'s actor handle and node id; ``job`` the Ray
    job of the driver that loaded it; ``since_ns`` when it registered (driver clock).
    """

    replica: str
    key: str
    path: str
    tp_size: int
    actors: tuple[Any, ...]
    nodes: tuple[str | None, ...]
    state: State = "loading"
    job: str = ""
    since_ns: int = 0

    def summary(self) -> dict[str, Any]:
        """The entry without actor handles, for ``rayload directory``."""
        return {
            "replica": self.replica,
            "key": self.key,
            "path": self.path,
            "tp_size": self.tp_size,
            "state": self.state,
            "job": self.job,
            "nodes": list(self.nodes),
            "age_s": round((time.time_ns() - self.since_ns) / 1e9, 1),
        }


class PeerDirectory:
    """The directory actor (plain class; wrapped with ``ray.remote`` by :func:`directory`)."""

    def __init__(self) -> None:
        self._entries: dict[str, ReplicaEntry] = {}

    def claim(self, entry: ReplicaEntry) -> list[ReplicaEntry]:
        """Register ``entry`` (state ``loading``); return the other replicas of its key,
        loaded ones first, oldest first."""
        holders = [e for e in self._entries.values() if e.key == entry.key]
        self._entries[entry.replica] = entry
        return sorted(holders, key=lambda e: (e.state != "loaded", e.since_ns))

    def mark(self, replica: str, state: State, key: str | None = None) -> bool:
        """Set a replica's state (and key, after a reload); False when it is unknown."""
        entry = self._entries.get(replica)
        if entry is None:
            return False
        self._entries[replica] = replace(entry, state=state, key=key or entry.key)
        return True

    def drop(self, replicas: Sequence[str]) -> int:
        """Forget these replicas; how many were known."""
        return sum(self._entries.pop(r, None) is not None for r in replicas)

    def entries(self) -> list[ReplicaEntry]:
        return sorted(self._entries.values(), key=lambda e: e.since_ns)


_RemoteDirectory: Any = ray.remote(PeerDirectory)


def directory(*, create: bool = True) -> Any:
    """The cluster's directory actor: the existing one, else (``create``) a new one; None
    when there is none and ``create`` is False."""
    if not create:
        try:
            return ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
        except ValueError:
            return None
    return _RemoteDirectory.options(
        name=DIRECTORY_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=0,
    ).remote()


def call(method: Any, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """``method.remote(*args)`` on the directory, waited for; raises
    :class:`DirectoryUnavailable` (with the reason) when the directory does not answer."""
    try:
        return ray.get(method.remote(*args), timeout=timeout_s)
    except GetTimeoutError as exc:
        raise DirectoryUnavailable(f"it did not answer within {timeout_s:g} s") from exc
    except RayError as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise DirectoryUnavailable(f"{type(exc).__name__}: {first}") from exc


class DirectoryUnavailable(Exception):
    """The directory could not be reached; loads then read storage."""


def live_holders(holders: Sequence[ReplicaEntry]) -> tuple[list[ReplicaEntry], list[str]]:
    """The holders whose every rank actor answers a ping within :data:`PING_TIMEOUT_S`,
    and the ids of the others (dead, or not answering: never used)."""
    pings = {
        replica.replica: [actor.peer_ping.remote() for actor in replica.actors]
        for replica in holders
    }
    refs = [ref for refs in pings.values() for ref in refs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_TIMEOUT_S)
    answered = set()
    for ref in ready:
        try:
            ray.get(ref)
            answered.add(ref)
        except RayError:
            pass
    live = [h for h in holders if all(ref in answered for ref in pings[h.replica])]
    dead = [h.replica for h in holders if h not in live]
    return live, dead


def replaced_since_last_use(actor: Any) -> bool:
    """Whether ``actor`` is another directory than the one this process used last (that
    one is gone: killed, or lost with its node); remembers ``actor`` for next time."""
    global _last_used
    actor_id = actor._actor_id.hex()
    replaced = _last_used not in (None, actor_id)
    _last_used = actor_id
    return replaced


def stop_directory() -> bool:
    """Kill the cluster's directory actor; False when there was none. Replicas still
    loaded keep their weights; loads after this start a new, empty directory."""
    global _last_used
    actor = directory(create=False)
    _last_used = None
    if actor is None:
        return False
    ray.kill(actor, no_restart=True)
    return True
