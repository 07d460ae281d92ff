"""The stand-ins of a dry run (:mod:`~rayload.integrations.dryrun`): tensors that behave
like a rank's shards for an engine's weight loaders without holding a byte.

A :class:`Stand` has the shard's shape and dtype on the ``meta`` device. Any operation
whose results are views of the shard (narrow, unsqueeze, unbind, indexing, reshaping
views: results that alias it, in its dtype) gives stand-ins, so their geometry (offset,
strides) says which elements of the shard they are. ``copy_`` and item assignment out of
a stand-in into a real tensor are recorded in the :class:`DryRun`, not performed. Any
other operation needs the bytes: it is recorded too, and runs on zeros of the stand-in's
shape (a :class:`Traced`, whose later copies are recorded to name the parameter), so the
loader goes on as it would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rayload.integrations.partial import METADATA
from rayload.loading.dtypes import torch_dtype
from rayload.loading.plan import TensorShard


@dataclass
class DryRun:
    """What the loaders did with the stand-ins: per tensor, its copies ``(destination,
    stand-in view)``; the first computation that needed its bytes; the destinations of
    copies made after that (of zeros), to name the parameter. ``current`` is the tensor a
    loader touched last, ``refused`` the destination of a copy whose shapes cannot match
    (what a loader's failure names)."""

    device: torch.device
    copies: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    needed: dict[str, str] = field(default_factory=dict)
    later: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    current: str | None = None
    refused: torch.Tensor | None = None

    def forget(self) -> None:
        """Drop every view of a parameter the run recorded. The stand-ins keep their run,
        and an engine may keep a stand-in after its dry run (vLLM 0.32 does): the views
        would keep the whole model's memory alive after the model is gone."""
        self.copies.clear()
        self.later.clear()
        self.refused = None


_GEOMETRY = METADATA | {
    torch.Tensor.stride,
    torch.Tensor.storage_offset,
    torch.Tensor.is_contiguous,
}
"""What a loader may ask of a stand-in without its bytes: its metadata, and its geometry
as a view of the shard."""


class Stand(torch.Tensor):
    """A stand-in for the bytes of one shard, or a view of them (on ``meta``: no memory).

    Views (any operation whose results alias the shard's stand-in, same dtype) give
    stand-ins; ``copy_`` and item assignment out of one are recorded in the dry run and
    not performed; anything else needs the bytes: recorded too, and run on zeros of the
    right shape (:class:`Traced`), so the loader can go on."""

    _name: str
    _run: DryRun
    _root: torch.Tensor

    @classmethod
    def of(cls, shard: TensorShard, run: DryRun) -> Stand:
        meta = torch.empty(shard.shape, dtype=torch_dtype(shard.dtype), device="meta")
        stand = torch.Tensor._make_subclass(cls, meta)
        stand._name, stand._run, stand._root = shard.name, run, stand
        return stand

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        stands = [a for a in _leaves((args, kwargs)) if isinstance(a, Stand)]
        stand = stands[0]
        run = stand._run
        run.current = stand._name
        if func in _GEOMETRY:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        into_real = not isinstance(args[0], Stand)
        if func is torch.Tensor.copy_ and into_real and isinstance(args[1], Stand):
            dest, source = args[0], args[1]
            if not _fits(source, dest):
                run.refused = dest
                raise RuntimeError(
                    f"a copy of shape {list(source.shape)} into {list(dest.shape)} cannot be made"
                )
            run.copies.setdefault(source._name, []).append((dest, source))
            return dest
        if func is torch.Tensor.__setitem__ and into_real and isinstance(args[2], Stand):
            target = args[0][args[1]]
            if _aliases(target, args[0]):
                run.copies.setdefault(args[2]._name, []).append((target, args[2]))
                return None
        name = getattr(func, "__name__", repr(func))
        if len(stands) == 1 and not name.endswith("_"):
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                pass  # a meta tensor cannot do it: it needs the bytes
            else:
                if _views_of(out, stand):
                    return _map(out, lambda t: Stand._view(t, stand))
        for each in stands:
            run.needed.setdefault(each._name, name)
        zeros = {id(s): torch.zeros(s.shape, dtype=s.dtype, device=run.device) for s in stands}
        real = _replace(args, zeros), _replace(kwargs, zeros)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*real[0], **real[1])
        return _map(out, lambda t: Traced.of(t, stand._name, run))

    @staticmethod
    def _view(tensor: torch.Tensor, of: Stand) -> Stand:
        view = tensor.as_subclass(Stand)
        view._name, view._run, view._root = of._name, of._run, of._root
        return view


class Traced(torch.Tensor):
    """Real bytes (zeros) standing in for a shard whose loader computes with it: every
    operation runs; a ``copy_`` out of it records the destination (to name the
    parameter)."""

    _name: str
    _run: DryRun

    @classmethod
    def of(cls, tensor: torch.Tensor, name: str, run: DryRun) -> Traced:
        traced = tensor.as_subclass(Traced)
        traced._name, traced._run = name, run
        return traced

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        traced = next(a for a in _leaves((args, kwargs)) if isinstance(a, Traced))
        if func is torch.Tensor.copy_ and args[1] is traced and not isinstance(args[0], Traced):
            traced._run.later.setdefault(traced._name, []).append(args[0])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in METADATA or any(out is a for a in args):
            return out
        return _map(out, lambda t: Traced.of(t, traced._name, traced._run))


def _fits(source: torch.Tensor, dest: torch.Tensor) -> bool:
    """Whether ``dest.copy_(source)`` can run: ``source`` broadcasts to ``dest``'s shape."""
    try:
        return tuple(torch.broadcast_shapes(source.shape, dest.shape)) == tuple(dest.shape)
    except RuntimeError:
        return False


def _views_of(out: Any, stand: Stand) -> bool:
    """Whether every tensor in ``out`` is a view of ``stand``'s shard (its dtype), and
    there is at least one."""
    tensors = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(
        t.dtype == stand._root.dtype and _aliases(t, stand._root) for t in tensors
    )


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` shares ``b``'s storage (a view of it), meta tensors included."""
    return bool(torch._C._is_alias_of(a, b))  # type: ignore[attr-defined]


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def _map(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        mapped = [_map(v, fn) for v in value]
        return mapped if isinstance(value, list) else type(value)(mapped)
    return value


def _replace(value: Any, zeros: Mapping[int, torch.Tensor]) -> Any:
    if isinstance(value, Stand):
        return zeros[id(value)]
    if isinstance(value, list | tuple):
        replaced = [_replace(v, zeros) for v in value]
        return replaced if isinstance(value, list) else type(value)(replaced)
    if isinstance(value, dict):
        return {k: _replace(v, zeros) for k, v in value.items()}
    return value
