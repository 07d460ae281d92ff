"""A checkpoint tensor of its full shape of which this rank holds only its shard: what an
engine's own weight loaders receive in place of the whole tensor.

An engine such as vLLM fills its partitioned parameters by calling each parameter's
weight loader with the *whole* checkpoint tensor, which the loader narrows to the rank's
part (``loaded_weight.narrow(dim, start, size)``) and copies into the parameter, stacked
(``qkv_proj``), padded (vocabulary) or per expert as the engine lays it out. Handing those
loaders a :class:`PartialTensor` keeps that layout logic the engine's own while only the
rank's bytes were read: the tensor has the full shape and dtype (on the ``meta`` device,
so it holds no memory), and ``narrow`` answers with the rank's real bytes when the range
asked for lies inside what rayload read (``unsqueeze``, and ``unbind`` off the split
dimension, give partial tensors of the same runs). Any other use of the tensor, or a range
outside the rank's shard, is a :class:`~rayload.errors.ShardingError` naming the tensor: the
engine's layout and rayload's plan disagree, and nothing is ever filled from bytes that
were not read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from rayload.errors import ShardingError

Run = tuple[int, torch.Tensor]
"""``(start, data)``: the rank's bytes of split-dimension indices ``start ..
start + data.shape[split] - 1``."""

METADATA: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
        torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
        torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
        torch.Tensor.device.__get__,
        torch.Tensor.is_meta.__get__,  # type: ignore[attr-defined]
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.__len__,
        torch.Tensor.__repr__,
        torch.Tensor.__format__,
    }
)
"""What a loader may ask of a partial tensor without its bytes."""
_NARROW: frozenset[Callable[..., Any]] = frozenset({torch.Tensor.narrow, torch.narrow})
_UNSQUEEZE: frozenset[Callable[..., Any]] = frozenset({torch.Tensor.unsqueeze, torch.unsqueeze})
_UNBIND: frozenset[Callable[..., Any]] = frozenset({torch.Tensor.unbind, torch.unbind})
"""Views that move no byte across the split dimension: vLLM's fused-MoE loader turns one
expert's weight into a stack of one (``unsqueeze(0)``) and takes it apart (``unbind()``)."""


class PartialTensor(torch.Tensor):
    """Tensor ``name`` of ``shape``, of which only the ``runs`` of dimension ``split`` are
    held (the rank's shard, cut into its pieces); see the module docstring.

    Build one with :func:`partial_tensor`, which returns the plain shard when it is the
    whole tensor.
    """

    _name: str
    _rank: int
    _split: int
    _runs: tuple[Run, ...]
    _whole: ClassVar[str] = "the whole tensor"

    @staticmethod
    def __new__(
        cls,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        split: int,
        runs: Sequence[Run],
        *,
        rank: int,
    ) -> PartialTensor:
        meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
        self = torch.Tensor._make_subclass(cls, meta)
        self._name, self._rank, self._split, self._runs = name, rank, split, tuple(runs)
        return self

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        partial = next(a for a in args if isinstance(a, PartialTensor))
        if args and args[0] is partial:
            if func in _NARROW:
                return partial._narrow(*args[1:], **kwargs)
            if func in _UNSQUEEZE:
                return partial._unsqueeze(*args[1:], **kwargs)
            if func in _UNBIND:
                return partial._unbind(*args[1:], **kwargs)
        raise partial._refusal(f"it called {getattr(func, '__name__', func)} on it")

    def _narrow(self, dim: int, start: int | torch.Tensor, length: int) -> torch.Tensor:
        """The rank's bytes of ``[start, start + length)`` of ``dim``: a plain tensor when
        they are all held, else a smaller partial tensor (a loader narrowing a fused
        tensor to one component first, then to the rank's part of it)."""
        shape = list(self.shape)
        dim = dim % len(shape)
        start = int(start)
        if not (start >= 0 and length >= 0 and start + length <= shape[dim]):
            raise self._refusal(f"it asked for {start}..{start + length} of dimension {dim}")
        shape[dim] = length
        if dim != self._split:
            runs = tuple((s, data.narrow(dim, start, length)) for s, data in self._runs)
            return self._rebuilt(shape, runs)
        pieces: list[tuple[int, torch.Tensor]] = []
        for s, data in self._runs:
            lo, hi = max(s, start), min(s + data.shape[dim], start + length)
            if lo < hi:
                pieces.append((lo - start, data.narrow(dim, lo - s, hi - lo)))
        return self._rebuilt(shape, tuple(pieces), asked=(start, length))

    def _unsqueeze(self, dim: int) -> PartialTensor:
        """The same runs with a new dimension of size 1 at ``dim``."""
        dim = dim % (self.dim() + 1)
        shape = list(self.shape)
        shape.insert(dim, 1)
        split = self._split + (dim <= self._split)
        runs = tuple((s, data.unsqueeze(dim)) for s, data in self._runs)
        return PartialTensor(self._name, shape, self.dtype, split, runs, rank=self._rank)

    def _unbind(self, dim: int = 0) -> tuple[torch.Tensor, ...]:
        """One partial tensor per index of ``dim``, which must not be the split one."""
        dim = dim % self.dim()
        if dim == self._split:
            raise self._refusal(f"it called unbind on dimension {dim}, the split one")
        shape = [n for d, n in enumerate(self.shape) if d != dim]
        split = self._split - (dim < self._split)
        return tuple(
            PartialTensor(
                self._name,
                shape,
                self.dtype,
                split,
                tuple((s, data.select(dim, i)) for s, data in self._runs),
                rank=self._rank,
            )
            for i in range(self.shape[dim])
        )

    def _rebuilt(
        self, shape: list[int], runs: tuple[Run, ...], asked: tuple[int, int] | None = None
    ) -> torch.Tensor:
        if _covers(runs, self._split, shape[self._split]):
            return _joined(runs, self._split)
        if asked is not None and not runs:
            start, length = asked
            raise self._refusal(
                f"it takes {start}..{start + length} of dimension {self._split}, of which "
                "this rank read nothing"
            )
        return PartialTensor(self._name, shape, self.dtype, self._split, runs, rank=self._rank)

    def _refusal(self, what: str) -> ShardingError:
        held = ", ".join(f"{s}..{s + d.shape[self._split]}" for s, d in self._runs) or "nothing"
        return ShardingError(
            f"rank {self._rank}: the engine's weight loader needs bytes of tensor "
            f"{self._name!r} {list(self.shape)} that rayload's plan does not give this rank "
            f"({what}; the rank holds {held} of dimension {self._split}): the engine lays "
            "this tensor out differently from rayload's sharding rules; pass a rules file "
            "that matches it (model_loader_extra_config rules=...)",
            tensor=self._name,
        )


def partial_tensor(
    name: str,
    shape: Sequence[int],
    split: int | None,
    pieces: Sequence[tuple[int, int]],
    shard: torch.Tensor,
    *,
    rank: int,
) -> torch.Tensor:
    """Tensor ``name`` of full ``shape`` as the rank holds it: ``shard`` itself when it is
    the whole tensor (replicated, or tp 1), else a :class:`PartialTensor` whose runs are the
    ``pieces`` (``(start, length)`` of dimension ``split``, in the shard's order) of
    ``shard``."""
    if split is None or tuple(shard.shape) == tuple(shape):
        return shard
    runs: list[Run] = []
    offset = 0
    for start, length in pieces:
        runs.append((start, shard.narrow(split, offset, length)))
        offset += length
    return PartialTensor(name, shape, shard.dtype, split, runs, rank=rank)


def _covers(runs: Sequence[Run], dim: int, size: int) -> bool:
    """Whether ``runs`` (sorted by start) hold every index of ``dim`` up to ``size``."""
    end = 0
    for start, data in sorted(runs, key=lambda run: run[0]):
        if start != end:
            return False
        end += data.shape[dim]
    return end == size


def _joined(runs: Sequence[Run], dim: int) -> torch.Tensor:
    ordered = [data for _, data in sorted(runs, key=lambda run: run[0])]
    return ordered[0] if len(ordered) == 1 else torch.cat(ordered, dim=dim)
