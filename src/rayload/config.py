"""One typed configuration of a load: :class:`LoadConfig`.

Each option of :func:`rayload.load` is one field here, declared once with its type,
default and a one-line doc; the command line's ``rayload load`` flags
(:mod:`rayload.cli.fields`), the JSON schema (``rayload config --schema``), the Serve
application args (:mod:`rayload.serve`), the config files (``--config FILE``) and the
table of options in docs/design.md all come from these fields.

The checks are :mod:`rayload.options`' (shared with the rank loader and the planner), run
as ``before`` validators so a bad value gets the same one message everywhere. Nothing here
touches the file system: ``path`` is any string (a local path, or ``s3://bucket/prefix``),
checked by the load itself.

Two arguments of a load are code, not configuration, and stay keyword arguments of
:func:`rayload.load` beside the config: ``model=`` (a factory) and ``progress=`` (a
callback); so does ``rules=`` when it is a parsed rule set rather than a file path.

Past 400 lines on purpose: the fields, each with its type, default, doc and flag, are the
one declaration of every option; the file reading and the error messages beside them are
what turn a bad value anywhere into the same one line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from rayload import options
from rayload.errors import ConfigError
from rayload.loading.methods import LoadMethod
from rayload.loading.storage.base import is_remote

Device = Literal["auto", "cpu", "cuda"]
ProcessGroup = Literal["auto", "gloo", "nccl"]
ModelRole = Literal["main", "draft"]
Strategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]

ERROR_TYPE = "rayload"
"""The pydantic error type of a value :mod:`rayload.options` rejected (its message names
the field)."""


@dataclass(frozen=True)
class Flag:
    """How a field is spelled on the command line (read by :mod:`rayload.cli.fields`):
    ``name`` (default ``--`` and the field's name with dashes), ``metavar``, and
    ``positional`` for the one positional argument."""

    name: str | None = None
    metavar: str | None = None
    positional: bool = False


def _fspath(value: object) -> object:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _path_value(_: str, value: object) -> str:
    value = _fspath(value)
    if not isinstance(value, str) or not value:
        raise ConfigError(
            "path must be a checkpoint directory, a .safetensors file or s3://bucket/prefix, "
            f"got {value!r}"
        )
    return value


def _optional_path(name: str, value: object) -> object:
    value = _fspath(value)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name} must be a path, got {value!r}")
    return value


def _process_group(_: str, value: object) -> object:
    options.check_process_group(value, "auto")  # the device is checked with it, after
    return value


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "path": _path_value,
    "tp_size": lambda _, v: options.check_tp_size(v),
    "method": lambda _, v: options.parse_method(v),
    "device": lambda _, v: options.check_device(v),
    "strict": options.check_flag,
    "rules": _optional_path,
    "expert_parallel": options.check_flag,
    "process_group": _process_group,
    "placement_strategy": lambda _, v: options.check_strategy(v),
    "trace_dir": _optional_path,
    "timeout": lambda _, v: options.check_timeout(v),
    "model_role": lambda _, v: options.check_model_role(v),
    "replicas": lambda _, v: options.check_replicas(v),
    "peers": options.check_flag,
    "peer_fanout": lambda _, v: options.check_peer_fanout(v),
    "shared_copy": options.check_flag,
}
"""Each field's check, ``check(name, value) -> value``: rayload.options' where it has one
(the rank loader and the planner use the same), so a bad value has one message."""


RANK_FIELDS = (
    "path",
    "tp_size",
    "method",
    "device",
    "strict",
    "rules",
    "model_role",
    "expert_parallel",
)
"""The fields that apply to one rank loaded in the current process (``load_rank``)."""


class LoadConfig(BaseModel):
    """Everything a load is asked to do, as data: ``rayload.load(LoadConfig(...))``.

    Frozen and ``extra="forbid"`` (a misspelled option is an error, never ignored). Build
    one from keyword arguments, a dict, a YAML or JSON file (:func:`read_config_file`) or
    Serve's application args; :meth:`of` is what ``rayload.load`` calls.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Annotated[
        str,
        Field(
            description="checkpoint: a directory with model.safetensors or an index and its "
            "shards, one converted by `rayload convert`, one .safetensors file, or "
            "s3://bucket/prefix"
        ),
        Flag(name="dir", positional=True),
    ]
    tp_size: Annotated[
        int,
        Field(description="tensor-parallel size: the number of ranks, one Ray actor each"),
        Flag(name="--tp", metavar="N"),
    ]
    method: Annotated[
        LoadMethod,
        Field(description="load method; auto chooses per rank from the node and the checkpoint"),
        Flag(metavar="METHOD"),
    ] = LoadMethod.AUTO
    device: Annotated[
        Device,
        Field(description="where the weights go; auto: the rank's GPU when Ray gave it one"),
        Flag(metavar="DEVICE"),
    ] = "auto"
    strict: Annotated[
        bool,
        Field(description="fail (exit 2) where a rank would fall back to another load method"),
        Flag(name="--strict-method"),
    ] = False
    rules: Annotated[
        str | None,
        Field(
            description="JSON file of sharding rules (none: the preset for config.json's "
            "architectures; with no preset every tensor is replicated)"
        ),
        Flag(metavar="FILE"),
    ] = None
    expert_parallel: Annotated[
        bool,
        Field(
            description="divide a mixture-of-experts model's experts among the ranks, whole, "
            "instead of splitting every expert"
        ),
    ] = False
    process_group: Annotated[
        ProcessGroup | None,
        Field(
            description="torch.distributed group across the ranks (none: no group); auto: "
            "nccl on CUDA, gloo on cpu"
        ),
        Flag(metavar="BACKEND"),
    ] = "auto"
    address: Annotated[
        str | None,
        Field(
            description="Ray to join: host:port, ray://..., auto, or local for a new local "
            "Ray (none: RAY_ADDRESS, else a `ray start` cluster here, else a new local Ray)"
        ),
        Flag(metavar="ADDR"),
    ] = None
    placement_strategy: Annotated[
        Strategy,
        Field(
            description="placement group strategy; inside a Ray Serve replica its own group is used"
        ),
        Flag(metavar="STRATEGY"),
    ] = "STRICT_PACK"
    trace_dir: Annotated[
        str | None,
        Field(
            description="write the trace here as OTLP JSON, Jaeger JSON, Chrome/Perfetto JSON "
            "and HTML (none: no files)"
        ),
        Flag(metavar="DIR"),
    ] = None
    otlp_endpoint: Annotated[
        str | None,
        Field(
            description="send the trace over OTLP: http(s)://.../v1/traces over HTTP, anything "
            "else over gRPC (none: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, else not sent)"
        ),
        Flag(metavar="URL"),
    ] = None
    timeout: Annotated[
        float,
        Field(description="seconds the whole load may take, placement included"),
        Flag(metavar="SECONDS"),
    ] = 600.0
    model_role: Annotated[
        ModelRole,
        Field(description="the model the load is for (draft: a speculative-decoding draft)"),
        Flag(metavar="ROLE"),
    ] = "main"
    replicas: Annotated[
        int,
        Field(
            description="data-parallel copies of the TP group, a placement group each; "
            "replica 0 reads storage, the others receive its bytes from it"
        ),
        Flag(metavar="N"),
    ] = 1
    peers: Annotated[
        bool,
        Field(
            description="use the cluster's peer directory: receive from other loads' "
            "replicas and offer them this one's (this load's replicas share regardless)"
        ),
    ] = True
    peer_fanout: Annotated[
        int,
        Field(
            description="replicas that a replica still loading forwards its bytes to as they "
            "land, so that replicas started together load as one pipelined tree (1: a "
            "chain; 0: receive only from replicas that have finished loading)"
        ),
        Flag(metavar="N"),
    ] = options.PEER_FANOUT
    shared_copy: Annotated[
        bool,
        Field(
            description="keep each loaded rank's shards in its node's Ray object store too, so "
            "a new replica on that node copies them from shared memory"
        ),
    ] = False

    @field_validator(*_CHECKS, mode="before")
    @classmethod
    def _checked(cls, value: object, info: ValidationInfo) -> Any:
        """The field's check from rayload.options (one message per bad value)."""
        name = info.field_name or ""
        return _check(lambda v: _CHECKS[name](name, v), value)

    @model_validator(mode="after")
    def _group_fits_device(self) -> LoadConfig:
        _check(lambda _: options.check_process_group(self.process_group, self.device), None)
        return self

    @classmethod
    def of(
        cls, path_or_config: LoadConfig | str | os.PathLike[str], /, **options: Any
    ) -> LoadConfig:
        """A config from ``rayload.load``'s arguments: a path and options, or a config and
        options that replace some of its fields. Raises
        :class:`~rayload.errors.ConfigError`, one line for every bad value."""
        if isinstance(path_or_config, LoadConfig):
            fields = {**path_or_config.model_dump(exclude_unset=True), **options}
        else:
            fields = {"path": path_or_config, **options}
        return cls.validated(fields)

    @classmethod
    def validated(cls, fields: Mapping[str, Any]) -> LoadConfig:
        """``LoadConfig(**fields)``, its :class:`ValidationError` turned into one
        :class:`~rayload.errors.ConfigError` line."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise ConfigError(validation_message(exc)) from None

    def rank_options(self) -> dict[str, Any]:
        """The fields a single rank's load takes, as keyword arguments of
        :func:`rayload.loading.load_rank` (and ``reload_rank``):
        ``load_rank(rank=1, **config.rank_options())``. The rest (placement, Ray, traces,
        replicas, peers) is the driver's."""
        return {name: getattr(self, name) for name in RANK_FIELDS}

    def replace(self, **changes: Any) -> LoadConfig:
        """This config with ``changes``, validated again."""
        return LoadConfig.of(self, **changes)


_TRUE, _FALSE = {"true", "yes", "1"}, {"false", "no", "0"}


def typed_text(name: str, value: object) -> object:
    """Field ``name``'s value from text (a ``key=value`` argument): an int, float or bool
    field's text as that type when it reads as one; anything else as it is, for the
    field's check to accept or name."""
    annotation = LoadConfig.model_fields[name].annotation
    if not isinstance(value, str) or annotation not in (int, float, bool):
        return value
    if annotation is bool:
        lowered = value.strip().lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else value
    try:
        return annotation(value)
    except ValueError:
        return value


def _check(check: Callable[[Any], Any], value: object) -> Any:
    """``check(value)``, its ConfigError as the pydantic error whose message is the
    ConfigError's (so :func:`validation_message` shows exactly that)."""
    try:
        return check(value)
    except ConfigError as exc:
        raise PydanticCustomError(ERROR_TYPE, str(exc)) from None


def validation_message(
    exc: ValidationError,
    *,
    source: str | None = None,
    fields: Iterable[str] = (),
    model: type[BaseModel] = LoadConfig,
) -> str:
    """One line for every error of ``exc``: rayload's own messages as they are, pydantic's
    as ``field: reason``; with ``source`` (a file's name) that name before each, except for
    the ``fields`` that did not come from it. ``model``: the model validated, whose options
    an unknown top-level key is told (a nested one is a LoadConfig's)."""
    from_elsewhere = set(fields)
    parts = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "config"
        message = _error_message(field, error, model if len(error["loc"]) == 1 else LoadConfig)
        if source is not None and field.split(".")[0] not in from_elsewhere:
            message = f"{source}: {message}"
        parts.append(message)
    return "; ".join(parts)


def _error_message(field: str, error: ErrorDetails, model: type[BaseModel]) -> str:
    if error["type"] == ERROR_TYPE:
        return error["msg"]
    if error["type"] == "missing":
        return f"{field} is required"
    if error["type"] == "extra_forbidden":
        known = ", ".join(model.model_fields)
        return f"{field}: no such option (the options are: {known})"
    return f"{field}: {error['msg']}"


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping of options in a YAML or JSON file (JSON is YAML too); not validated.
    :class:`~rayload.errors.ConfigError` naming the file when it cannot be read or is not
    one mapping."""
    import yaml

    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as stream:
            data = yaml.safe_load(stream)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read the config file: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"{name}: not a YAML or JSON file: {reason}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{name}: expected a mapping of option names to values, got a {type(data).__name__}"
        )
    return data


PATH_FIELDS = ("path", "rules", "trace_dir")
"""Fields that name local files: relative in a config file means relative to that file."""


def _beside(config_file: str | os.PathLike[str], fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with each relative local path of :data:`PATH_FIELDS` made relative to the
    config file's directory (as a file written beside the checkpoint expects; ``s3://``
    and absolute paths stay as they are)."""
    here = os.path.dirname(os.path.abspath(config_file))
    beside = dict(fields)
    for name in PATH_FIELDS:
        value = beside.get(name)
        if isinstance(value, str) and value and not is_remote(value) and not os.path.isabs(value):
            beside[name] = os.path.join(here, value)
    return beside


def config_from_file(
    path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None
) -> LoadConfig:
    """The config in the YAML or JSON file at ``path``, ``overrides`` (e.g. command-line
    flags) replacing its values; the file's relative paths are relative to the file. A bad
    value is one :class:`~rayload.errors.ConfigError` line that names the file (when the
    value came from it), the field and the reason."""
    given = dict(overrides or {})
    fields = {**_beside(path, read_config_file(path)), **given}
    try:
        return LoadConfig(**fields)
    except ValidationError as exc:
        message = validation_message(exc, source=os.fspath(path), fields=given)
        raise ConfigError(message) from None


__all__ = [
    "Flag",
    "LoadConfig",
    "config_from_file",
    "read_config_file",
]
