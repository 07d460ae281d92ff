"""``rayload directory``: the replicas the cluster's peer directory offers to new loads."""

from __future__ import annotations

import argparse
import sys

from rayload.cli.common import AddCommand, add_json
from rayload.errors import ConfigError, RayloadError


def _cmd_directory(args: argparse.Namespace) -> int:
    import contextlib
    import json

    import ray

    from rayload.actors.directory import (
        DIRECTORY_NAME,
        NAMESPACE,
        DirectoryUnavailable,
        call,
        directory,
        stop_directory,
    )
    from rayload.cli_output import directory_table

    name = f"{DIRECTORY_NAME} in namespace {NAMESPACE}"
    stdout = sys.stdout  # as in `load`: Ray's notices go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        started_ray = _join_cluster(args.address)
        try:
            actor = directory(create=False)
            entries, silent = [], None
            if actor is not None:
                try:
                    entries = call(actor.entries, timeout_s=_DIRECTORY_TIMEOUT_S)
                except DirectoryUnavailable as exc:
                    silent = exc
            stopped = args.stop and actor is not None and stop_directory()
        finally:
            if started_ray:
                ray.shutdown()
    if silent is not None and not stopped:
        raise RayloadError(
            f"the peer directory ({name}) does not answer: {silent}; `rayload directory "
            "--stop` kills it, and the next load starts a new one"
        )
    replicas = [entry.summary() for entry in entries]
    if args.json:
        doc: dict[str, object] = {
            "directory": DIRECTORY_NAME,
            "namespace": NAMESPACE,
            "running": actor is not None and not stopped,
            "replicas": replicas,
        }
        if args.stop:
            doc["stopped"] = stopped
        print(json.dumps(doc), file=stdout)
        return 0
    if actor is None:
        print(
            f"no peer directory on this cluster ({name}): no load with peers ran here since "
            "the cluster started or the directory was stopped",
            file=stdout,
        )
        return 0
    if replicas:
        print(directory_table(replicas), file=stdout)
    elif silent is None:
        print(f"the peer directory ({name}) lists no replica", file=stdout)
    if stopped:
        listed = "" if silent is None else f" (it did not answer: {silent})"
        print(
            f"stopped the peer directory{listed}; the replicas it listed keep their weights "
            "but are no longer offered to new loads",
            file=stdout,
        )
    return 0


_DIRECTORY_TIMEOUT_S = 10.0
"""How long ``rayload directory`` waits for the directory to answer."""


def _join_cluster(address: str | None) -> bool:
    """Join the running cluster at ``address`` (as ``load`` finds it) for a command that
    only looks at it; True when this call ran ``ray.init``. Nothing found, or ``local``,
    is a :class:`~rayload.errors.ConfigError`: a new local Ray has nothing to show."""
    import time

    import ray

    from rayload import cluster

    if ray.is_initialized():
        return False
    found = cluster.find_address(address)
    if found.address in (None, "local"):
        raise ConfigError(
            "no Ray cluster to look in (no --address, RAY_ADDRESS or `ray start` cluster on "
            "this machine): pass --address host:port of the cluster the loads ran on"
        )
    try:
        cluster.check_reachable(found)
    except ConfigError as exc:
        cause = exc.__cause__
        reason = getattr(cause, "strerror", None) or str(cause or exc)
        raise ConfigError(
            f"cannot reach a Ray cluster at {found.address} ({found.describe()}): {reason}; "
            "pass the --address of the running cluster the loads ran on"
        ) from exc
    return cluster.connect(address, deadline=time.monotonic() + cluster.CONNECT_TIMEOUT_S)


_DIRECTORY_EPILOG = """\
One detached actor per cluster (rayload-peer-directory, namespace rayload) maps each
checkpoint and plan (the peer key) to the replicas that hold it; loads with peers create
it and register there. States: loading, loaded.

examples:
  rayload directory --address 10.0.0.1:6379
  rayload directory --json
  rayload directory --stop"""


def add_commands(add: AddCommand) -> None:
    p = add(
        "directory",
        _cmd_directory,
        "list the replicas the cluster's peer directory offers to new loads",
        _DIRECTORY_EPILOG,
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="Ray cluster to look in: host:port, ray://... or auto (default: RAY_ADDRESS, "
        "else a `ray start` cluster on this machine)",
    )
    p.add_argument(
        "--stop",
        action="store_true",
        help="then kill the directory: loaded replicas keep their weights, new loads start "
        "an empty one",
    )
    add_json(p, "the replicas (replica, key, path, tp_size, state, job, nodes, age_s)")
