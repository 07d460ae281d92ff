"""The one exception tree of rayload.

::

    RayloadError                      root: catch this to catch everything rayload raises
    ├── InputError                    bad input or arguments; the CLI exits with code 2
    │   ├── CheckpointError           a checkpoint file, header, index or manifest is wrong
    │   │   └── StorageError          object storage refused or failed a request: missing
    │   │                             bucket or key, access denied, unreachable endpoint,
    │   │                             an object that changed during the load
    │   ├── ShardingError             a tensor cannot be split as the rules say
    │   ├── ConfigError               a user option, rules file or device request is invalid
    │   ├── ModelMismatchError        the engine's module (``model=``) and the rank's shards
    │   │                             disagree: a parameter, tensor or shape has no match
    │   └── MethodUnavailableError    the requested load method cannot run here and
    │                                 ``strict`` forbids falling back
    └── LoadFailedError               a load started but did not finish; the CLI exits with 1
        ├── RankFailedError           one rank raised, or its actor died
        ├── RankTimeoutError          one rank did not finish within the timeout
        └── ClusterLostError          the Ray cluster's head (GCS) stopped answering

Messages name the file, tensor, rank or node concerned and say what to do. Foreign
exceptions (``OSError``, ``json.JSONDecodeError``, Ray's errors) are translated at the
boundary with ``raise ... from exc`` so the cause stays attached.
"""

from __future__ import annotations

from typing import Any


class RayloadError(Exception):
    """Root of every error rayload raises on purpose."""

    exit_code = 1

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its message and every attribute, whatever arguments its class's
        ``__init__`` requires: a rank's error crosses Ray to the driver whole."""
        return (_rebuild, (type(self), self.args), self.__dict__)


def _rebuild(cls: type[RayloadError], args: tuple[Any, ...]) -> RayloadError:
    error = cls.__new__(cls)
    error.args = args
    return error


class InputError(RayloadError):
    """The user's input (paths, files, options) is wrong; nothing was loaded.

    ``rank`` and ``node_id`` are None, except on an error a rank found and the driver
    re-raised (``rayload.load``): then they name that rank and its node.
    """

    exit_code = 2
    rank: int | None = None
    node_id: str | None = None


class CheckpointError(InputError):
    """A checkpoint is malformed or inconsistent.

    ``file`` and ``tensor`` name what is wrong so a caller can act on it without
    parsing the message.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.file = file
        self.tensor = tensor


class StorageError(CheckpointError):
    """Object storage could not give the checkpoint's bytes. ``url`` is the object or
    prefix (``s3://bucket/key``); ``missing`` is True when it does not exist. The message
    names the bucket, key and endpoint, and for access denied where the credentials came
    from, never their value."""

    def __init__(self, message: str, *, url: str, missing: bool = False):
        super().__init__(message, file=url)
        self.url = url
        self.missing = missing


class ShardingError(InputError):
    """A tensor cannot be sharded as the rules ask (e.g. a dimension not divisible by tp)."""

    def __init__(self, message: str, *, tensor: str | None = None, file: str | None = None):
        super().__init__(message)
        self.tensor = tensor
        self.file = file


class ConfigError(InputError):
    """An option, a rules file or a device request is invalid."""


class ModelMismatchError(InputError):
    """The module a ``model=`` factory built does not fit the rank's shards: a parameter
    with no tensor, a tensor with no parameter, a shape or dtype that differs, a meta buffer
    nothing fills. ``rank``, ``parameter`` and ``tensor`` say where (None when not known).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        parameter: str | None = None,
        tensor: str | None = None,
    ):
        super().__init__(message)
        self.rank = rank
        self.parameter = parameter
        self.tensor = tensor


class MethodUnavailableError(InputError):
    """``strict`` was set and the requested load method would have fallen back."""


class LoadFailedError(RayloadError):
    """A load started but at least one rank did not finish it."""

    exit_code = 1


class RankFailedError(LoadFailedError):
    """A rank raised or its actor died. ``rank``, ``node_id`` and ``cause`` say which and why."""

    def __init__(self, message: str, *, rank: int, node_id: str | None, cause: str):
        super().__init__(message)
        self.rank = rank
        self.node_id = node_id
        self.cause = cause


class RankTimeoutError(LoadFailedError):
    """A rank did not finish within the load's timeout."""

    def __init__(self, message: str, *, rank: int, node_id: str | None, timeout_s: float):
        super().__init__(message)
        self.rank = rank
        self.node_id = node_id
        self.timeout_s = timeout_s


class ClusterLostError(LoadFailedError):
    """The Ray cluster's head (its GCS) stopped answering during a load. ``phase`` says what
    the driver was waiting for, ``address`` is the GCS, ``log_dir`` Ray's logs (or None)."""

    def __init__(self, message: str, *, phase: str, address: str, log_dir: str | None):
        super().__init__(message)
        self.phase = phase
        self.address = address
        self.log_dir = log_dir
