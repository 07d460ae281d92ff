"""Which slot of the engine's module each of a rank's shards goes to, and every way they
disagree: the matching :mod:`rayload.loading.fill` fills by (vLLM's
``stacked_params_mapping`` names the pieces of a stacked parameter) and its checks, one
:class:`~rayload.errors.ModelMismatchError` naming the rank, the parameter or tensor and
the shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rayload.errors import ModelMismatchError

if TYPE_CHECKING:
    import torch
    from torch import nn

StackedMapping = Sequence[tuple[str, str, str]]
"""``(param_fragment, shard_fragment, shard_id)`` entries, as vLLM's
``stacked_params_mapping``, e.g. ``(".qkv_proj", ".k_proj", "k")``."""

_SHOWN_PROBLEMS = 5


@dataclass
class Slot:
    """A parameter or buffer of the module: every (submodule, attribute) that holds it
    (more than one when tied) and its first full name."""

    name: str
    tensor: torch.Tensor
    owners: list[tuple[nn.Module, str]]
    is_buffer: bool


def match_checked(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], rank: int
) -> tuple[dict[str, Slot], StackedMapping, dict[str, str], dict[str, list[tuple[str, str]]]]:
    """The module's slots, its stacked mapping and where each tensor goes (``_match``);
    raises one :class:`ModelMismatchError` listing every disagreement."""
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
    return slots, mapping, direct, stacked


def _slots(module: nn.Module) -> dict[str, Slot]:
    """Every name a parameter or buffer answers to -> its slot (tied names share one)."""
    by_id: dict[int, Slot] = {}
    names: dict[str, Slot] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(owner, kind).items():
                if tensor is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                slot = by_id.get(id(tensor))
                if slot is None:
                    slot = Slot(name, tensor, [], is_buffer=kind == "_buffers")
                    by_id[id(tensor)] = slot
                if (owner, attr) not in slot.owners:
                    slot.owners.append((owner, attr))
                names.setdefault(name, slot)
    return names


def _match(
    tensors: Mapping[str, torch.Tensor], slots: Mapping[str, Slot], mapping: StackedMapping
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
    slots: Mapping[str, Slot],
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
    slot: Slot,
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


def stacking_order(
    name: str, pieces: Sequence[tuple[str, str]], mapping: StackedMapping
) -> list[str]:
    """The tensor names of stacked parameter ``name``'s pieces in stacking order."""
    by_id = dict(pieces)
    return [by_id[shard_id] for shard_id in _piece_order(name, mapping)]


def _shape(tensor: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in tensor.shape) + ")"


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
