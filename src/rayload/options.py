"""The options users pass to rayload, and their checks: one place for each, shared by the
command line, the Python API, the rank actors and the planner, so the same bad value gets
the same message everywhere.

Import-light on purpose (no Ray, no torch): the CLI builds its choices from here without
paying for either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayload.errors import ConfigError

if TYPE_CHECKING:
    from rayload.loading.methods import LoadMethod

DEVICES = ("auto", "cpu", "cuda")
"""``device=`` / ``--device``: the rank's GPU when Ray gave it one (auto), cpu or cuda."""

PROCESS_GROUPS = ("auto", "gloo", "nccl")
"""``process_group=`` backends (or None: no group); the CLI spells None ``none``."""

MODEL_ROLES = ("main", "draft")
"""``model_role=``: the model a load is for (a draft model for speculative decoding)."""

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
"""Ray placement group strategies a load's group may use."""


def check_tp_size(tp_size: object) -> int:
    """``tp_size`` as an int; ConfigError unless it is a positive integer."""
    return _positive_int("tp_size", tp_size)


def check_replicas(replicas: object) -> int:
    """``replicas`` as an int; ConfigError unless it is a positive integer."""
    return _positive_int("replicas", replicas)


PEER_FANOUT = 2
"""How many replicas that start later one replica still loading forwards its bytes to, as
they land (``LoadConfig.peer_fanout``): the replicas loading together form a tree of this
fan-out (docs/design.md "Pipelined fan-out")."""


def check_peer_fanout(fanout: object) -> int:
    """``peer_fanout`` as an int; ConfigError unless it is an integer of 0 or more."""
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 0:
        raise ConfigError(f"peer_fanout must be an integer of 0 or more, got {fanout!r}")
    return fanout


def check_flag(name: str, value: object) -> bool:
    """``value`` as a bool; ConfigError unless it is True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_rank(rank: object, tp_size: int) -> int:
    """``rank`` as an int; ConfigError unless it is in ``0..tp_size-1``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise ConfigError(f"rank must be in 0..{tp_size - 1} for tp_size {tp_size}, got {rank!r}")
    return rank


def check_model_role(model_role: object) -> str:
    """``model_role`` as a str; ConfigError unless it is one of :data:`MODEL_ROLES`."""
    if model_role not in MODEL_ROLES:
        raise ConfigError(f"model_role must be one of {', '.join(MODEL_ROLES)}, got {model_role!r}")
    return str(model_role)


def check_device(device: object) -> str:
    """``device`` as a str; ConfigError unless it is one of :data:`DEVICES`."""
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    return str(device)


def check_strategy(strategy: object) -> str:
    """``strategy`` as a str; ConfigError unless it is one of :data:`STRATEGIES`."""
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"unknown placement strategy {strategy!r}; use one of: {', '.join(STRATEGIES)}"
        )
    return str(strategy)


def check_process_group(value: object, device: str) -> None:
    """``process_group`` (one of :data:`PROCESS_GROUPS` or None) for ``device``;
    ConfigError otherwise, and for ``nccl`` on the CPU."""
    if value is not None and value not in PROCESS_GROUPS:
        raise ConfigError(
            f"process_group must be one of {', '.join(PROCESS_GROUPS)} or None, got {value!r}"
        )
    if value == "nccl" and device == "cpu":
        raise ConfigError(
            "process_group='nccl' needs CUDA devices but device='cpu'; use "
            "process_group='gloo' (or 'auto'), or device='cuda'"
        )


def check_timeout(timeout: object) -> float:
    """``timeout`` in seconds as a float; ConfigError unless it is a number > 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
    return float(timeout)


def parse_method(method: object) -> LoadMethod:
    """``method`` as a :class:`~rayload.loading.methods.LoadMethod`; ConfigError listing
    the valid values if unknown."""
    from rayload.loading.methods import LoadMethod

    try:
        return LoadMethod(method)
    except ValueError:
        valid = ", ".join(m.value for m in LoadMethod)
        raise ConfigError(f"unknown load method {method!r}; valid values: {valid}") from None
