"""Ray Serve glue: what every deployment whose replica holds a TP model loaded by rayload
needs, so a deployment's own code is its model's.

- :class:`ServeArgs`: the application's typed args (a :class:`~rayload.config.LoadConfig`
  under ``load`` plus the serving options), as ``applications[].args`` of a Serve config
  file gives them;
- :func:`replica_bundles`: the placement bundles of a TP replica (bundle 0 the replica
  itself, bundles ``1..tp_size`` its rank actors, which ``rayload.load`` finds and uses);
- :class:`TPReplica`: a deployment class's base that loads in its async constructor (in
  a worker thread: the replica's event loop never blocks, and Serve routes no traffic to
  it before the weights are resident), answers ``GET`` and the handle method
  ``load_report`` with what its load did, and closes the load when the replica goes;
- :func:`application`: ``serve run``/``serve deploy``'s builder body: the args checked
  (bad ones are one :class:`ServeArgsError` line, Serve's deploy error, or ``serve run``'s
  exit 2, before any replica or rank actor starts), the deployment sized and bound.

::

    class Model(rayload.serve.TPReplica):
        async def __call__(self, request): ...     # self.result: the LoadResult

    def build_app(args: dict) -> Application:
        return rayload.serve.application(Model, args, model=build_model)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Annotated, Any

import click
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.exceptions import RayServeException

from rayload.config import LoadConfig, typed_text, validation_message
from rayload.errors import ConfigError
from rayload.loading.model import ModelFactory
from rayload.placement import rank_bundles
from rayload.result import LoadResult

AUTOSCALING: dict[str, float] = {
    # One request at a time per replica: a second one waiting means another replica helps.
    "target_ongoing_requests": 1,
    # A replica that loads from a peer is ready in seconds: scale up without waiting long.
    "upscale_delay_s": 1.0,
    "look_back_period_s": 2.0,
    # Deprecated in Ray 2.60 for RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S, still honoured.
    "metrics_interval_s": 0.5,
}
"""Serve's autoscaling options with ``max_replicas`` (min 1; Serve's defaults otherwise)."""


class ServeArgs(BaseModel):
    """The args of a rayload Serve application (``applications[].args`` in a config file)::

    args:
      load: {path: /models/llama, tp_size: 2, device: cuda}
      max_replicas: 4
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    load: Annotated[LoadConfig, Field(description="what each replica loads (LoadConfig)")]
    replicas: Annotated[
        int, Field(ge=1, description="replicas of the deployment, without max_replicas")
    ] = 1
    max_replicas: Annotated[
        int | None,
        Field(ge=1, description="autoscale from 1 to this many replicas on waiting requests"),
    ] = None
    cpus_per_bundle: Annotated[
        float,
        Field(gt=0, description="CPUs of the replica's bundle and of each rank's bundle"),
    ] = 0.01

    @classmethod
    def of(cls, args: ServeArgs | Mapping[str, Any]) -> ServeArgs:
        """``args`` checked; one :class:`ConfigError` line for every bad value. A dotted
        key is a nested one (``load.tp_size=2``: what ``serve run module:app key=value``
        can pass); a LoadConfig field's text there reads as its type
        (:func:`~rayload.config.typed_text`)."""
        if isinstance(args, ServeArgs):
            return args
        misplaced = [k for k in args if k in LoadConfig.model_fields and k not in cls.model_fields]
        if misplaced:
            raise ConfigError(
                f"rayload Serve args: {misplaced[0]} is an option of the load: give it as "
                f"load.{misplaced[0]} (or under load: in a config file)"
            )
        try:
            return cls.model_validate(_nest_dotted(args))
        except ValidationError as exc:
            message = validation_message(exc, model=cls)
            raise ConfigError(f"rayload Serve args: {message}") from None


class ServeArgsError(RayServeException, click.UsageError):
    """Bad Serve args, understood where the builder runs: Serve's controller
    (``serve deploy``, a config's ``serve run``) shows a :class:`RayServeException` as the
    application's one-line deploy error; Serve's command line (``serve run module:app
    key=value``, where the builder runs inside its click command) prints a click usage
    error as ``Error: ...`` and exits 2, without a traceback."""

    def __init__(self, message: str) -> None:
        click.UsageError.__init__(self, message)

    def __str__(self) -> str:
        return self.message


def _nest_dotted(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with each dotted key (``load.path``) moved into its nested mapping (kept
    as it is where that key holds something else, for the validation to name)."""
    nested: dict[str, Any] = {}
    for key, value in args.items():
        *parents, leaf = str(key).split(".")
        if parents == ["load"] and leaf in LoadConfig.model_fields:
            value = typed_text(leaf, value)
        target = nested
        for parent in parents:
            inner = target.get(parent)
            if isinstance(inner, BaseModel):
                inner = inner.model_dump(exclude_unset=True)
            if inner is not None and not isinstance(inner, Mapping):
                target, leaf = nested, str(key)
                break
            target[parent] = inner = dict(inner or {})
            target = inner
        target[leaf] = value
    return nested


def replica_bundles(
    tp_size: int, *, use_gpus: bool, cpus_per_bundle: float = 0.01
) -> list[dict[str, float]]:
    """The placement bundles of one TP replica: bundle 0 for the replica itself, bundles
    ``1..tp_size`` for its rank actors (a GPU each with ``use_gpus``)."""
    ranks = rank_bundles(tp_size, use_gpus=use_gpus, cpus_per_rank=cpus_per_bundle)
    return [{"CPU": cpus_per_bundle}, *ranks]


def deployment_options(args: ServeArgs) -> dict[str, Any]:
    """``serve.deployment`` options for ``args``: the replica's actor and placement group
    (:func:`replica_bundles`, the load's ``placement_strategy``) and its scaling."""
    load = args.load
    scaling: dict[str, Any] = {"num_replicas": args.replicas}
    if args.max_replicas is not None:
        scaling = {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": args.max_replicas}
            | AUTOSCALING
        }
    return {
        "ray_actor_options": {"num_cpus": args.cpus_per_bundle},
        "placement_group_bundles": replica_bundles(
            load.tp_size, use_gpus=load.device == "cuda", cpus_per_bundle=args.cpus_per_bundle
        ),
        "placement_group_strategy": load.placement_strategy,
        **scaling,
    }


def load_report(result: LoadResult) -> dict[str, Any]:
    """What a replica's load did: trace id, the Serve replica's id, rayload's replica id
    and peer key, per-rank reports (``method``, ``bytes_from_storage``,
    ``bytes_from_peers``, ``source``...), startup metrics and warnings."""
    return {
        "trace_id": result.trace_id,
        "serve_replica": serve.get_replica_context().replica_id.unique_id,
        "replica_id": result.replica_ids[0],
        "peer_key": result.peer_key,
        "tp_size": result.tp_size,
        "ranks": [report.to_dict() for report in result.ranks],
        "startup_metrics": result.startup_metrics,
        "warnings": result.warnings,
    }


class TPReplica:
    """Base of a deployment class: one replica = one load, a TP group of rank actors.

    ``self.result`` is the :class:`~rayload.result.LoadResult` (``apply`` runs code on
    every rank), ``self.report`` its :func:`load_report`. ``GET`` on the route and the
    handle method :meth:`load_report` return the report; a subclass's ``__call__`` handles
    its own requests and may ``return await super().__call__(request)`` for the rest.
    """

    # Serve awaits an async constructor; mypy knows only plain ones.
    async def __init__(  # type: ignore[misc]
        self, config: LoadConfig, model: ModelFactory | None = None
    ) -> None:
        self.result = await asyncio.to_thread(_load, config, model)
        self.report = load_report(self.result)

    async def load_report(self) -> dict[str, Any]:
        """What this replica's load did (as ``GET``), for handle callers."""
        return self.report

    async def __call__(self, request: Any) -> Any:
        if request.method == "GET":
            return self.report
        from starlette.responses import PlainTextResponse

        return PlainTextResponse(f"{request.method} is not served here\n", status_code=405)

    def __del__(self) -> None:
        result = getattr(self, "result", None)
        if result is not None:
            result.close()  # stops the rank actors; the placement group is Serve's


def _load(config: LoadConfig, model: ModelFactory | None) -> LoadResult:
    from rayload.api import load

    return load(config, model=model)


def application(
    cls: type[TPReplica],
    args: ServeArgs | Mapping[str, Any],
    *,
    model: ModelFactory | None = None,
    name: str | None = None,
) -> Any:
    """The Serve application of deployment class ``cls`` for ``args``
    (:class:`ServeArgs`, or the mapping a config file gives), each replica loading
    ``args.load`` with ``model=``. Bad args raise one :class:`ServeArgsError` line naming
    the field and the reason, before anything starts (``serve deploy`` shows it as the
    application's error, ``serve run module:app key=value`` exits 2 with it)."""
    try:
        checked = ServeArgs.of(args)
    except ConfigError as exc:
        raise ServeArgsError(str(exc)) from None
    deployment = serve.deployment(name=name or cls.__name__, **deployment_options(checked))(cls)
    return deployment.bind(checked.load, model)


def parse_token_ids(body: bytes, vocab: int) -> list[int]:
    """The ``token_ids`` of a ``POST /`` body (``{"token_ids": [...]}``), each below
    ``vocab``; ValueError with a one-line reason otherwise."""
    try:
        request = json.loads(body)
    except ValueError:
        raise ValueError('the body is not JSON; send {"token_ids": [1, 2, 3]}') from None
    ids = request.get("token_ids") if isinstance(request, dict) else None
    if not isinstance(ids, list) or not ids:
        raise ValueError('send a JSON object {"token_ids": [...]} with at least one id')
    if not all(type(i) is int and 0 <= i < vocab for i in ids):
        raise ValueError(f"token_ids must be integers in [0, {vocab})")
    return ids


__all__ = [
    "AUTOSCALING",
    "ServeArgs",
    "ServeArgsError",
    "TPReplica",
    "application",
    "deployment_options",
    "load_report",
    "parse_token_ids",
    "replica_bundles",
]
