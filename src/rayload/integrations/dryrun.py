"""Where each tensor of a rank's shard lands in an engine's parameters, learnt from the
engine's own weight loaders before any byte is read: a dry run.

An engine such as vLLM fills its parameters by handing each checkpoint tensor to a weight
loader, which narrows it to the rank's part and copies it into a region of a parameter
(``qkv_proj``'s k rows, an expert's half of ``w13``, the first rows of a padded
vocabulary). Reading the bytes into a buffer first and letting the loader copy them costs
a second copy, and the buffer's memory. :func:`find_destinations` instead runs the
engine's ``load_weights`` once on *stand-ins*: tensors of the shard's shape and dtype on
the ``meta`` device (:class:`~rayload.integrations.partial.PartialTensor` s of them where
the rank holds part of a tensor), so the loaders run exactly as they would, but every
view they take is only arithmetic and every ``copy_`` out of a stand-in is recorded, not
performed: the destination (a view of the parameter) and which elements of the shard go
there. A shard whose copies put its bytes, in order, into one contiguous region of one
parameter, of its dtype, on the load device, is then read straight into that region
(:attr:`Destinations.direct`). Any other tensor goes through the engine's weight loader
with its bytes as before (:attr:`Destinations.through_loaders`), for a reason of
:data:`REASONS`:

* ``dtype``: the parameter's dtype is not the checkpoint's (the loader's ``copy_``
  converts);
* ``transform``: the loader computes with the tensor (anything but views and copies: a
  transpose made contiguous, a scale's ``item()``, arithmetic); the dry run then gives the
  loader zeros of the right shape so it can go on, and the real bytes overwrite them when
  the tensor is loaded through the loader;
* ``layout``: the copies do not make one region in the tensor's own order (a strided
  region of the parameter, a copy into two parameters), or the parameter is on another
  device than the load's;
* ``quantized``, ``method`` and ``off``: decided by the caller (a parameter its engine
  quantizes or repacks as it loads; a load method that reads into memory of its own;
  direct fill turned off).

A tensor no loader copied anywhere is not read at all (:attr:`Destinations.unused`: e.g.
a tied ``lm_head.weight`` the engine skips). The dry run's other effects on the
parameters are the loaders' own (vLLM zeroes a padded vocabulary's last rows) and stay.
Engine-agnostic and Ray-free: the engine's integration supplies ``load_weights`` and what
a parameter is (:data:`ParameterOf`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rayload.errors import CheckpointError, MethodUnavailableError, RayloadError
from rayload.integrations.partial import partial_tensor
from rayload.integrations.standins import DryRun, Stand
from rayload.loading.dtypes import torch_dtype
from rayload.loading.plan import RankPlan, TensorShard

REASONS: dict[str, str] = {
    "dtype": "dtype conversion",
    "transform": "a weight loader that computes with the tensor",
    "layout": "not a plain region of the parameter",
    "quantized": "a quantized parameter",
    "method": "a load method that reads into memory of its own",
    "off": "direct fill turned off",
}
"""Why a tensor goes through the engine's weight loader: code -> what the report says."""

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
"""The engine's ``model.load_weights(weights)``; what it returns is kept
(:attr:`Destinations.loaded`)."""
ParameterOf = Callable[[torch.Tensor], tuple[str, str | None]]
"""``destination -> (parameter name, why it cannot be filled directly or None)``, for a
view of an engine's parameter that a loader copied into."""


@dataclass(frozen=True)
class Fallback:
    """Tensor ``tensor`` goes through the engine's weight loader into ``parameter`` (None:
    unknown) because of ``reason`` (a key of :data:`REASONS`); ``detail`` says how."""

    tensor: str
    parameter: str | None
    reason: str
    detail: str

    def describe(self) -> str:
        into = f" into parameter {self.parameter!r}" if self.parameter else ""
        return f"tensor {self.tensor!r}{into}: {REASONS[self.reason]} ({self.detail})"


@dataclass(frozen=True)
class Destinations:
    """Where a rank's shards go. ``direct``: name -> the region of a parameter to read the
    shard into (a view of the parameter's memory, of the shard's shape and dtype);
    ``through_loaders``: name -> why not; ``unused``: tensors no loader took; ``loaded``:
    what the engine's ``load_weights`` returned in the dry run (None without one)."""

    direct: dict[str, torch.Tensor] = field(default_factory=dict)
    through_loaders: dict[str, Fallback] = field(default_factory=dict)
    unused: tuple[str, ...] = ()
    loaded: Any = None

    def split(self, plan: RankPlan) -> tuple[RankPlan, RankPlan]:
        """``plan`` cut into the shards read straight into parameters and those loaded
        through the weight loaders (unused ones in neither), each in the plan's order."""
        direct = tuple(s for s in plan.shards if s.name in self.direct)
        loaders = tuple(s for s in plan.shards if s.name in self.through_loaders)
        return (
            RankPlan(plan.rank, plan.tp_size, direct),
            RankPlan(plan.rank, plan.tp_size, loaders),
        )

    def loader_bytes(self, plan: RankPlan) -> dict[str, int]:
        """Bytes of ``plan`` through the weight loaders, by reason (reasons with none left
        out)."""
        by_reason: dict[str, int] = {}
        for shard in plan.shards:
            fallback = self.through_loaders.get(shard.name)
            if fallback is not None:
                by_reason[fallback.reason] = by_reason.get(fallback.reason, 0) + shard.nbytes
        return by_reason

    def refuse_fallbacks(self, rank: int) -> None:
        """MethodUnavailableError naming the first tensor, its parameter and the reason
        when any tensor would go through a weight loader (``strict``)."""
        if not self.through_loaders:
            return
        first = next(iter(self.through_loaders.values()))
        more = len(self.through_loaders) - 1
        raise MethodUnavailableError(
            f"rank {rank}: {first.describe()} would go through the engine's weight loader, "
            f"not straight into the parameter"
            + (f" (and {more} more)" if more else "")
            + "; strict mode forbids it (drop strict, or load the checkpoint in the "
            "engine's dtype and layout)"
        )


def through_loaders(plan: RankPlan, reason: str, detail: str) -> Destinations:
    """Every shard of ``plan`` through the weight loaders for ``reason`` (no dry run)."""
    return Destinations(
        through_loaders={s.name: Fallback(s.name, None, reason, detail) for s in plan.shards}
    )


def find_destinations(
    load_weights: LoadWeights,
    plan: RankPlan,
    *,
    device: torch.device,
    parameter_of: ParameterOf,
) -> Destinations:
    """Run ``load_weights`` on stand-ins of ``plan``'s shards (module docstring) and route
    each shard: straight into a region of a parameter on ``device``, through the weight
    loaders (and why), or unused. Raises what the engine's loaders raise (a stand-in
    refuses, as a :class:`~rayload.integrations.partial.PartialTensor` does, any range the
    rank did not plan)."""
    run = DryRun(device)

    def stand_ins() -> Iterator[tuple[str, torch.Tensor]]:
        for shard in plan.shards:
            stand = Stand.of(shard, run)
            yield (
                shard.name,
                partial_tensor(
                    shard.name, shard.full_shape, shard.split, shard.pieces, stand, rank=plan.rank
                ),
            )

    try:
        try:
            loaded = load_weights(stand_ins())
        except RayloadError:
            raise
        except Exception as exc:  # the engine's loader refused a tensor: name it
            raise _refusal(exc, run, plan, parameter_of) from exc
        direct: dict[str, torch.Tensor] = {}
        fallbacks: dict[str, Fallback] = {}
        unused: list[str] = []
        with torch._C.DisableTorchFunctionSubclass():  # the stand-ins' geometry, as it is
            for shard in plan.shards:
                route = _route(shard, run, device, parameter_of)
                if isinstance(route, Fallback):
                    fallbacks[shard.name] = route
                elif route is None:
                    unused.append(shard.name)
                else:
                    direct[shard.name] = route
    finally:
        run.forget()
    return Destinations(direct, fallbacks, tuple(unused), loaded)


def _refusal(
    exc: Exception, run: DryRun, plan: RankPlan, parameter_of: ParameterOf
) -> CheckpointError:
    """The error of an engine's weight loader that failed on a stand-in (its shapes and the
    checkpoint's disagree): names the tensor, the parameter and both shapes."""
    shards = {s.name: s for s in plan.shards}
    shard = shards.get(run.current or "")
    dest = run.refused if run.refused is not None else _parameter_in(exc)
    tensor = f"{shard.name!r} {list(shard.full_shape)}" if shard else "a checkpoint tensor"
    into = "its parameter"
    if dest is not None:
        into = f"parameter {parameter_of(dest)[0]!r} {list(dest.shape)}"
    return CheckpointError(
        f"rank {plan.rank}: the engine's weight loader cannot put checkpoint tensor {tensor} "
        f"into {into} ({type(exc).__name__}: {exc or 'its shapes differ'}): the checkpoint "
        "and the engine's model config disagree; nothing was read",
        tensor=shard.name if shard else None,
    )


def _parameter_in(exc: BaseException) -> torch.Tensor | None:
    """The innermost ``param`` tensor of the frames ``exc`` went through (vLLM's weight
    loaders name the parameter they fill ``param``), if any."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("param")
        if isinstance(candidate, torch.Tensor):
            found = candidate
        tb = tb.tb_next
    return found


def _route(
    shard: TensorShard, run: DryRun, device: torch.device, parameter_of: ParameterOf
) -> torch.Tensor | Fallback | None:
    """The region of a parameter ``shard`` is read into, why it is not, or None (no loader
    took it)."""
    copies = run.copies.get(shard.name, [])
    name = shard.name
    if name in run.needed:
        later = run.later.get(name) or [d for d, _ in copies]
        parameter = parameter_of(later[0])[0] if later else None
        return Fallback(name, parameter, "transform", f"it calls {run.needed[name]} on it")
    if not copies:
        return None
    spans = []
    for dest, source in copies:
        parameter, why = parameter_of(dest)
        if why is not None:
            return Fallback(name, parameter, "quantized", why)
        if dest.dtype != source.dtype:
            detail = f"checkpoint {_dtype(source)}, parameter {_dtype(dest)}"
            return Fallback(name, parameter, "dtype", detail)
        if dest.device != device:
            detail = f"the parameter is on {dest.device}, the load on {device}"
            return Fallback(name, parameter, "layout", detail)
        start = _contiguous_start(source)
        if start is None or tuple(dest.shape) != tuple(source.shape) or not dest.is_contiguous():
            return Fallback(name, parameter, "layout", "a strided region or a reshaping copy")
        spans.append((start, source.numel(), dest, parameter))
    region = _region(shard, sorted(spans, key=lambda s: s[0]))
    if region is None:
        detail = "its parts land apart, or in more than one parameter"
        return Fallback(name, spans[0][3], "layout", detail)
    return region


def _region(
    shard: TensorShard, spans: list[tuple[int, int, torch.Tensor, str]]
) -> torch.Tensor | None:
    """The parameter memory the sorted ``spans`` (``(first element of the shard, elements,
    destination, parameter)``) make, as a tensor of the shard's shape: None unless they
    tile the shard in order into one contiguous run of one storage."""
    first = spans[0][2]
    storage = first.untyped_storage()
    itemsize = first.element_size()
    base = first.data_ptr() - spans[0][0] * itemsize
    end = 0
    for start, count, dest, _ in spans:
        same = dest.untyped_storage().data_ptr() == storage.data_ptr()
        if start != end or not same or dest.data_ptr() != base + start * itemsize:
            return None
        end += count
    if end != _numel(shard.shape):
        return None
    region = torch.empty(0, dtype=torch.uint8, device=first.device)
    region.set_(storage, base - storage.data_ptr(), (end * itemsize,), (1,))
    return region.view(torch_dtype(shard.dtype)).view(shard.shape)


def _contiguous_start(view: torch.Tensor) -> int | None:
    """The first element of the shard that ``view`` (a view of a stand-in) covers, when it
    covers one run of the shard's elements in order; None otherwise."""
    if view.numel() == 0:
        return int(view.storage_offset())
    dims = [(n, s) for n, s in zip(view.shape, view.stride(), strict=True) if n != 1]
    while len(dims) > 1 and dims[-2][1] == dims[-1][0] * dims[-1][1]:
        (outer, _), (inner, stride) = dims[-2], dims.pop()
        dims[-1] = (outer * inner, stride)
    if len(dims) > 1 or (dims and dims[-1][1] != 1):
        return None
    return int(view.storage_offset())


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
