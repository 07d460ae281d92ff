"""The safetensors dtype strings rayload understands, with their torch dtype and size.

One table, :data:`DTYPES`, is the single source of truth: header validation, shard
planning, the backends and the synthetic checkpoint writer all look dtypes up here.
"""

from __future__ import annotations

import torch

from rayload.errors import CheckpointError


def _optional(name: str) -> torch.dtype | None:
    """A torch dtype that older torch builds may lack (float8, unsigned > 8 bits)."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


_CANDIDATES: dict[str, tuple[torch.dtype | None, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "F8_E4M3": (_optional("float8_e4m3fn"), 1),
    "F8_E5M2": (_optional("float8_e5m2"), 1),
    "U16": (_optional("uint16"), 2),
    "I16": (torch.int16, 2),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "U32": (_optional("uint32"), 4),
    "I32": (torch.int32, 4),
    "F32": (torch.float32, 4),
    "U64": (_optional("uint64"), 8),
    "I64": (torch.int64, 8),
    "F64": (torch.float64, 8),
}

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    name: (dtype, size) for name, (dtype, size) in _CANDIDATES.items() if dtype is not None
}
"""safetensors dtype string -> (torch dtype, bytes per element)."""

_BY_TORCH: dict[torch.dtype, str] = {dtype: name for name, (dtype, _) in DTYPES.items()}


def itemsize(dtype: str, *, file: str, tensor: str) -> int:
    """Bytes per element of safetensors dtype ``dtype``.

    ``file`` and ``tensor`` only serve the error: an unknown dtype raises
    :class:`CheckpointError` naming both.
    """
    try:
        return DTYPES[dtype][1]
    except KeyError:
        raise CheckpointError(
            f"{file}: tensor {tensor!r} has dtype {dtype!r}, which rayload does not know "
            f"(known: {', '.join(DTYPES)}); re-save the checkpoint in a supported dtype",
            file=file,
            tensor=tensor,
        ) from None


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of safetensors dtype ``dtype`` (KeyError if unknown: validate first)."""
    return DTYPES[dtype][0]


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of torch dtype ``dtype``."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no safetensors equivalent") from None
