"""Filling the engine's module on a rank from the rank's shards, in place.

Ray-free: :mod:`rayload.loading.model` calls it on the rank; unit tests call it directly.

:func:`fill_model` puts the rank's shards into the module *without a second copy of the
weights*:

* a parameter on the ``meta`` device is replaced by ``nn.Parameter(shard)``: the same
  storage (zero copy), so the module takes the shard's device and memory;
* a parameter with real storage was read into directly when :func:`destinations` gave the
  read its memory (the shard already *is* the parameter: nothing to do); otherwise it gets
  ``param.data.copy_(shard)`` (dtype converted by ``copy_``), then the rank's tensor is
  pointed at the parameter so the shard is freed;
* a *stacked* parameter (``qkv_proj`` made of the checkpoint's ``q_proj``, ``k_proj``,
  ``v_proj``; ``gate_up_proj`` of ``gate_proj``, ``up_proj``) is allocated once (or is the
  module's own), each piece read into its rows (:func:`destinations`) or copied there,
  and the pieces replaced by ``narrow`` views of it, so they are freed and
  ``LoadResult.shard(rank, name)`` still answers.

:func:`destinations` is the step before the read: given the rank's plan it checks the
module against the shards (the same errors, before any byte is read) and returns the
memory each shard is read into: the parameter itself, the rows of a stacked parameter
(allocated then when it is on meta), or a fresh tensor where the module has none of the
shard's dtype (a meta parameter, which then takes it; a dtype ``copy_`` converts).

Names follow vLLM's ``stacked_params_mapping``: the module (its class) may carry
``stacked_params_mapping`` entries ``(param_fragment, shard_fragment, shard_id)``; a tensor
whose name contains ``shard_fragment`` goes into the parameter named with
``param_fragment`` instead, at its place in the dim-0 concatenation of the pieces, in the
order the mapping lists that parameter's shard ids.

Every disagreement between the module and the shards is one :class:`ModelMismatchError`
(an :class:`~rayload.errors.InputError`: exit 2) naming the rank, the parameter or tensor
and the shapes.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rayload.loading.fill_match import Slot, match_checked, stacking_order

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rayload.loading.plan import RankPlan


@dataclass(frozen=True)
class ModelFill:
    """What :func:`fill_model` did on one rank.

    ``parameters`` and ``buffers`` count the module's slots filled (tied parameters once);
    ``stacked`` the stacked parameters assembled from pieces; ``zero_copy`` the parameters
    and buffers that took a shard's storage; ``direct_bytes`` the bytes read straight into
    the module's own memory (:func:`destinations`); ``copied_bytes`` the bytes copied in
    after the read (a dtype conversion; a load not given :func:`destinations`).
    """

    parameters: int
    buffers: int
    stacked: int
    zero_copy: int
    copied_bytes: int
    direct_bytes: int = 0

    def attributes(self) -> dict[str, Any]:
        """As span attributes of ``rank.model.fill``."""
        return {
            "model.parameters": self.parameters,
            "model.buffers": self.buffers,
            "model.stacked": self.stacked,
            "model.zero_copy": self.zero_copy,
            "model.copied_bytes": self.copied_bytes,
            "model.direct_bytes": self.direct_bytes,
        }


def fill_model(
    module: nn.Module, tensors: MutableMapping[str, torch.Tensor], *, rank: int
) -> ModelFill:
    """Fill ``module``'s parameters and buffers from ``tensors`` (the rank's shards by
    checkpoint name), in place, without a second copy of the weights (module docstring).

    On return every entry of ``tensors`` shares storage with the module (the parameter
    itself, or a view of a stacked one). Raises :class:`ModelMismatchError` naming
    ``rank``, the parameter or tensor and the shapes when they disagree; nothing is
    changed then.
    """
    slots, mapping, direct, stacked = match_checked(module, tensors, rank)
    zero_copy = copied = in_place = 0
    filled: set[str] = set()
    for tensor_name, slot_name in direct.items():
        slot = slots[slot_name]
        if slot.name in filled:
            tensors[tensor_name] = slot.tensor.detach()
            continue
        shard = tensors[tensor_name]
        if slot.tensor.is_meta:
            slot.tensor = _adopt(slot, shard)
            zero_copy += 1
        elif _is(shard, slot.tensor):
            in_place += _nbytes(shard)
        else:
            slot.tensor.data.copy_(shard)
            copied += _nbytes(shard)
        tensors[tensor_name] = slot.tensor.detach()
        filled.add(slot.name)
    for slot_name, pieces in stacked.items():
        ordered = stacking_order(slot_name, pieces, mapping)
        stack_copied, stack_in_place = _stack(slots[slot_name], ordered, tensors)
        copied += stack_copied
        in_place += stack_in_place
        filled.add(slots[slot_name].name)
    unique = {slot.name: slot for slot in slots.values() if slot.name in filled}
    return ModelFill(
        parameters=sum(1 for slot in unique.values() if not slot.is_buffer),
        buffers=sum(1 for slot in unique.values() if slot.is_buffer),
        stacked=len(stacked),
        zero_copy=zero_copy,
        copied_bytes=copied,
        direct_bytes=in_place,
    )


def destinations(
    module: nn.Module, plan: RankPlan, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The memory each shard of ``plan`` is read into so that :func:`fill_model` copies
    nothing the module can hold as read (module docstring): the parameter or buffer
    itself where it has the shard's dtype and is contiguous on ``device``, the shard's
    rows of a stacked parameter (allocated here, in the module, when it is on meta),
    else a fresh tensor. Raises :class:`ModelMismatchError` as :func:`fill_model` does,
    before any byte is read."""
    import torch

    from rayload.loading.dtypes import torch_dtype

    device = torch.device(device)
    shapes = {
        s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device="meta") for s in plan.shards
    }
    slots, mapping, direct, stacked = match_checked(module, shapes, plan.rank)
    into = {name: _fresh(shape, device) for name, shape in shapes.items()}
    for tensor_name, slot_name in direct.items():
        target = slots[slot_name].tensor
        if _holds(target, shapes[tensor_name], device):
            into[tensor_name] = target.detach()
    for slot_name, pieces in stacked.items():
        slot = slots[slot_name]
        ordered = stacking_order(slot_name, pieces, mapping)
        if slot.tensor.is_meta:
            _materialize(slot, shapes[ordered[0]].dtype, device)
        offset = 0
        for name in ordered:
            rows = shapes[name].shape[0]
            view = slot.tensor.detach().narrow(0, offset, rows)
            if _holds(view, shapes[name], device):
                into[name] = view
            offset += rows
    return into


def _adopt(slot: Slot, shard: torch.Tensor) -> torch.Tensor:
    """Put ``shard`` itself (same storage) into every owner of a meta slot."""
    from torch import nn

    if slot.is_buffer:
        for owner, attr in slot.owners:
            owner._buffers[attr] = shard
        return shard
    param = nn.Parameter(shard, requires_grad=False)
    for owner, attr in slot.owners:
        owner._parameters[attr] = param
    return param


def _stack(
    slot: Slot, pieces: Sequence[str], tensors: MutableMapping[str, torch.Tensor]
) -> tuple[int, int]:
    """Copy the ``pieces`` (tensor names, in stacking order) into the stacked parameter
    (allocated here when it is on meta), replacing each piece by a view of it; returns the
    bytes copied and the bytes that were read into their rows already."""
    first = tensors[pieces[0]]
    if slot.tensor.is_meta:
        _materialize(slot, first.dtype, first.device)
    target = slot.tensor.detach()
    offset = copied = in_place = 0
    for name in pieces:
        piece = tensors[name]
        rows = piece.shape[0]
        view = target.narrow(0, offset, rows)
        if _is(piece, view):
            in_place += _nbytes(piece)
        else:
            view.copy_(piece)
            copied += _nbytes(piece)
        tensors[name] = view
        offset += rows
    return copied, in_place


def _materialize(slot: Slot, dtype: torch.dtype, device: torch.device) -> None:
    """Give a meta stacked parameter storage (uninitialized) in every owner."""
    import torch
    from torch import nn

    storage = torch.empty(tuple(slot.tensor.shape), dtype=dtype, device=device)
    param = nn.Parameter(storage, requires_grad=False)
    for owner, attr in slot.owners:
        owner._parameters[attr] = param
    slot.tensor = param


def _holds(target: torch.Tensor, shard: torch.Tensor, device: torch.device) -> bool:
    """Whether the shard's bytes can be read into ``target`` as they are."""
    return (
        not target.is_meta
        and target.device == device
        and target.dtype == shard.dtype
        and tuple(target.shape) == tuple(shard.shape)
        and target.is_contiguous()
    )


def _is(tensor: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``target``'s memory (it was read into it)."""
    return (
        tensor.data_ptr() == target.data_ptr()
        and tensor.dtype == target.dtype
        and tuple(tensor.shape) == tuple(target.shape)
        and tensor.device == target.device
    )


def _fresh(shape: torch.Tensor, device: torch.device) -> torch.Tensor:
    import torch

    return torch.empty(tuple(shape.shape), dtype=shape.dtype, device=device)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
