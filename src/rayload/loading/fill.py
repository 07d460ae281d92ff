"""Filling the engine's module on a rank from the rank's shards, in place.

Ray-free: :func:`rayload.loading.model.build_and_fill` calls it on the rank; unit tests
call it directly.

:func:`fill_model` puts the rank's shards into the module *without a second copy of the
weights*:

* a parameter on the ``meta`` device is replaced by ``nn.Parameter(shard)``: the same
  storage (zero copy), so the module takes the shard's device and memory;
* a parameter with real storage gets ``param.data.copy_(shard)`` (dtype converted by
  ``copy_``), then the rank's tensor is pointed at the parameter so the shard is freed;
  the module itself was a second copy until then, which is why meta is the recommended way;
* a *stacked* parameter (``qkv_proj`` made of the checkpoint's ``q_proj``, ``k_proj``,
  ``v_proj``; ``gate_up_proj`` of ``gate_proj``, ``up_proj``) is allocated once (or is the
  module's own), each piece copied into its rows, and the pieces replaced by ``narrow``
  views of it, so they are freed and ``LoadResult.shard(rank, name)`` still answers.

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

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rayload.errors import ModelMismatchError

if TYPE_CHECKING:
    import torch
    from torch import nn

StackedMapping = Sequence[tuple[str, str, str]]
"""``(param_fragment, shard_fragment, shard_id)`` entries, as vLLM's
``stacked_params_mapping``, e.g. ``(".qkv_proj", ".k_proj", "k")``."""

_SHOWN_PROBLEMS = 5


@dataclass(frozen=True)
class ModelFill:
    """What :func:`fill_model` did on one rank.

    ``parameters`` and ``buffers`` count the module's slots filled (tied parameters once);
    ``stacked`` the stacked parameters assembled from pieces; ``zero_copy`` the parameters
    and buffers that took a shard's storage; ``copied_bytes`` the bytes copied (real-device
    parameters, stacked pieces).
    """

    parameters: int
    buffers: int
    stacked: int
    zero_copy: int
    copied_bytes: int

    def attributes(self) -> dict[str, Any]:
        """As span attributes of ``rank.model.fill``."""
        return {
            "model.parameters": self.parameters,
            "model.buffers": self.buffers,
            "model.stacked": self.stacked,
            "model.zero_copy": self.zero_copy,
            "model.copied_bytes": self.copied_bytes,
        }


@dataclass
class _Slot:
    """A parameter or buffer of the module: every (submodule, attribute) that holds it
    (more than one when tied) and its first full name."""

    name: str
    tensor: torch.Tensor
    owners: list[tuple[nn.Module, str]]
    is_buffer: bool


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
    slots = _slots(module)
    mapping = tuple(getattr(module, "stacked_params_mapping", ()) or ())
    direct, stacked, unmatched = _match(tensors, slots, mapping)
    problems = _check(rank, tensors, slots, mapping, direct, stacked, unmatched)
    if problems:
        first, parameter, tensor = problems[0]
        more = [p for p, _, _ in problems[1:]]
        if more:
            shown = "; ".join(more[:_SHOWN_PROBLEMS])
            extra = len(more) - _SHOWN_PROBLEMS
            first += f" (and {len(more)} more: {shown}{f'; ... {extra} more' if extra > 0 else ''})"
        raise ModelMismatchError(first, rank=rank, parameter=parameter, tensor=tensor)
    zero_copy = copied = 0
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
        else:
            slot.tensor.data.copy_(shard)
            copied += shard.numel() * shard.element_size()
        tensors[tensor_name] = slot.tensor.detach()
        filled.add(slot.name)
    for slot_name, pieces in stacked.items():
        by_id = dict(pieces)
        ordered = [by_id[shard_id] for shard_id in _piece_order(slot_name, mapping)]
        copied += _stack(slots[slot_name], ordered, tensors)
        filled.add(slots[slot_name].name)
    unique = {slot.name: slot for slot in slots.values() if slot.name in filled}
    return ModelFill(
        parameters=sum(1 for slot in unique.values() if not slot.is_buffer),
        buffers=sum(1 for slot in unique.values() if slot.is_buffer),
        stacked=len(stacked),
        zero_copy=zero_copy,
        copied_bytes=copied,
    )


def _slots(module: nn.Module) -> dict[str, _Slot]:
    """Every name a parameter or buffer answers to -> its slot (tied names share one)."""
    by_id: dict[int, _Slot] = {}
    names: dict[str, _Slot] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(owner, kind).items():
                if tensor is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                slot = by_id.get(id(tensor))
                if slot is None:
                    slot = _Slot(name, tensor, [], is_buffer=kind == "_buffers")
                    by_id[id(tensor)] = slot
                if (owner, attr) not in slot.owners:
                    slot.owners.append((owner, attr))
                names.setdefault(name, slot)
    return names


def _match(
    tensors: Mapping[str, torch.Tensor], slots: Mapping[str, _Slot], mapping: StackedMapping
) -> tuple[dict[str, str], dict[str, list[tuple[str, str]]], list[str]]:
    """Which slot each tensor goes to: ``direct`` (tensor -> slot name), ``stacked``
    (parameter -> its (shard_id, tensor) pieces) and the tensors that go nowhere."""
    direct: dict[str, str] = {}
    stacked: dict[str, list[tuple[str, str]]] = {}
    unmatched: list[str] = []
    for name in tensors:
        if name in slots:
            direct[name] = name
            continue
        for param_fragment, shard_fragment, shard_id in mapping:
            if shard_fragment not in name:
                continue
            target = name.replace(shard_fragment, param_fragment)
            if target in slots and not slots[target].is_buffer:
                stacked.setdefault(target, []).append((shard_id, name))
                break
        else:
            unmatched.append(name)
    return direct, stacked, unmatched


def _check(
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    slots: Mapping[str, _Slot],
    mapping: StackedMapping,
    direct: Mapping[str, str],
    stacked: Mapping[str, list[tuple[str, str]]],
    unmatched: Sequence[str],
) -> list[tuple[str, str | None, str | None]]:
    """Every disagreement as ``(message, parameter, tensor)``, in the module's order."""
    problems: list[tuple[str, str | None, str | None]] = []
    where = f"rank {rank}"
    for name in unmatched:
        problems.append(
            (
                f"{where}: tensor {name!r} {_shape(tensors[name])} of the rank's shards has no "
                "parameter or buffer in the model (the module names it differently; add a "
                "stacked_params_mapping entry if it is one piece of a stacked parameter)",
                None,
                name,
            )
        )
    for tensor_name, slot_name in direct.items():
        slot, shard = slots[slot_name], tensors[tensor_name]
        kind = "buffer" if slot.is_buffer else "parameter"
        if tuple(slot.tensor.shape) != tuple(shard.shape):
            problems.append(
                (
                    f"{where}: {kind} {slot_name!r} has shape {_shape(slot.tensor)} but the "
                    f"rank's shard {tensor_name!r} has shape {_shape(shard)} (is the module "
                    "built for this rank's tp_size?)",
                    slot_name,
                    tensor_name,
                )
            )
        elif slot.tensor.is_meta and slot.tensor.dtype != shard.dtype:
            problems.append(
                (
                    f"{where}: meta {kind} {slot_name!r} is {_dtype(slot.tensor)} but the "
                    f"rank's shard {tensor_name!r} is {_dtype(shard)}: a meta module takes "
                    "the shard's storage as is; build it with the checkpoint's dtype",
                    slot_name,
                    tensor_name,
                )
            )
    for slot_name, pieces in stacked.items():
        problem = _check_stacked(where, slot_name, slots[slot_name], pieces, tensors, mapping)
        if problem is not None:
            problems.append((problem, slot_name, None))
    filled = {slots[s].name for s in direct.values()} | {slots[s].name for s in stacked}
    seen: set[str] = set()
    for slot in slots.values():
        if slot.name in filled or slot.name in seen:
            continue
        seen.add(slot.name)
        if not slot.is_buffer:
            problems.append(
                (
                    f"{where}: parameter {slot.name!r} {_shape(slot.tensor)} has no tensor "
                    f"in the rank's shards ({len(tensors)} tensors; is it named differently "
                    "in the checkpoint, or a piece of a stacked parameter the module's "
                    "stacked_params_mapping does not list?)",
                    slot.name,
                    None,
                )
            )
        elif slot.tensor.is_meta:
            problems.append(
                (
                    f"{where}: buffer {slot.name!r} {_shape(slot.tensor)} is on the meta "
                    "device and no tensor of the rank's shards fills it; create it on the "
                    "rank's device (context.device) in the factory",
                    slot.name,
                    None,
                )
            )
    return problems


def _check_stacked(
    where: str,
    name: str,
    slot: _Slot,
    pieces: Sequence[tuple[str, str]],
    tensors: Mapping[str, torch.Tensor],
    mapping: StackedMapping,
) -> str | None:
    order = _piece_order(name, mapping)
    got = dict(pieces)
    if len(got) != len(pieces) or set(got) != set(order):
        missing = [sid for sid in order if sid not in got]
        given = ", ".join(sorted(s for s, _ in pieces))
        return (
            f"{where}: stacked parameter {name!r} {_shape(slot.tensor)} is made of pieces "
            f"{', '.join(order)} but the rank's shards give {given}"
            + (f" (missing {', '.join(missing)})" if missing else " (a piece twice)")
        )
    shards = [tensors[got[sid]] for sid in order]
    described = " + ".join(f"{sid} {_shape(tensors[got[sid]])}" for sid in order)
    dtypes = {t.dtype for t in shards}
    if any(tuple(t.shape[1:]) != tuple(slot.tensor.shape[1:]) for t in shards) or sum(
        t.shape[0] for t in shards
    ) != (slot.tensor.shape[0] if slot.tensor.dim() else -1):
        return (
            f"{where}: stacked parameter {name!r} has shape {_shape(slot.tensor)} but its "
            f"pieces {described} of the rank's shards do not stack to it along dim 0"
        )
    if len(dtypes) > 1 or (slot.tensor.is_meta and dtypes != {slot.tensor.dtype}):
        return (
            f"{where}: stacked parameter {name!r} is {_dtype(slot.tensor)} but its pieces "
            f"are {', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}; build "
            "the module with the checkpoint's dtype"
        )
    return None


def _piece_order(name: str, mapping: StackedMapping) -> list[str]:
    """The shard ids of stacked parameter ``name`` in the order the mapping lists them."""
    order: list[str] = []
    for param_fragment, _, shard_id in mapping:
        if param_fragment in name and shard_id not in order:
            order.append(shard_id)
    return order


def _adopt(slot: _Slot, shard: torch.Tensor) -> torch.Tensor:
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


def _stack(slot: _Slot, pieces: Sequence[str], tensors: MutableMapping[str, torch.Tensor]) -> int:
    """Copy the ``pieces`` (tensor names, in stacking order) into the stacked parameter
    (allocated here when it is on meta), replacing each piece by a view of it; returns the
    bytes copied."""
    import torch
    from torch import nn

    first = tensors[pieces[0]]
    if slot.tensor.is_meta:
        storage = torch.empty(tuple(slot.tensor.shape), dtype=first.dtype, device=first.device)
        param = nn.Parameter(storage, requires_grad=False)
        for owner, attr in slot.owners:
            owner._parameters[attr] = param
        slot.tensor = param
    target = slot.tensor.detach()
    offset = copied = 0
    for name in pieces:
        piece = tensors[name]
        rows = piece.shape[0]
        view = target.narrow(0, offset, rows)
        view.copy_(piece)
        copied += piece.numel() * piece.element_size()
        tensors[name] = view
        offset += rows
    return copied


def _shape(tensor: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in tensor.shape) + ")"


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
