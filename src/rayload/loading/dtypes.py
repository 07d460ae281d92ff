"""The safetensors dtype strings rayload understands, with their torch dtype and size.

One table, :data:`_TABLE`, is the single source of truth: header validation, shard
planning, the backends and the synthetic checkpoint writer all look dtypes up here.
Reading headers and planning only need sizes (:data:`ITEMSIZE`), so importing this module
does not import torch; :data:`DTYPES` (name -> (torch dtype, size)) and
:func:`torch_dtype` import it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rayload.errors import CheckpointError

if TYPE_CHECKING:
    import torch

_TABLE: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),  # MX block scales (DeepSeek-V3.1-style UE8M0)
    "U16": ("uint16", 2),
    "I16": ("int16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "U32": ("uint32", 4),
    "I32": ("int32", 4),
    "F32": ("float32", 4),
    "U64": ("uint64", 8),
    "I64": ("int64", 8),
    "F64": ("float64", 8),
}
"""safetensors dtype string -> (name of the torch dtype, bytes per element)."""

ITEMSIZE: dict[str, int] = {name: size for name, (_, size) in _TABLE.items()}
"""safetensors dtype string -> bytes per element."""

_torch_table: dict[str, tuple[torch.dtype, int]] | None = None


def _dtypes() -> dict[str, tuple[torch.dtype, int]]:
    """The torch half of the table, built once; dtypes this torch lacks are left out."""
    global _torch_table
    if _torch_table is None:
        import torch

        _torch_table = {
            name: (getattr(torch, attr), size)
            for name, (attr, size) in _TABLE.items()
            if isinstance(getattr(torch, attr, None), torch.dtype)
        }
    return _torch_table


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # safetensors dtype string -> (torch dtype, bytes per element)
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def itemsize(dtype: str, *, file: str, tensor: str) -> int:
    """Bytes per element of safetensors dtype ``dtype``.

    ``file`` and ``tensor`` only serve the error: an unknown dtype raises
    :class:`CheckpointError` naming both.
    """
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise CheckpointError(
            f"{file}: tensor {tensor!r} has dtype {dtype!r}, which rayload does not know "
            f"(known: {', '.join(ITEMSIZE)}); re-save the checkpoint in a supported dtype",
            file=file,
            tensor=tensor,
        ) from None


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of safetensors dtype ``dtype``.

    KeyError if unknown (headers are validated first); TypeError when this torch build
    lacks it (e.g. float8 on an old torch).
    """
    table = _dtypes()
    if dtype not in table and dtype in _TABLE:
        raise TypeError(f"this torch build has no {_TABLE[dtype][0]} for safetensors {dtype}")
    return table[dtype][0]


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of torch dtype ``dtype``."""
    for name, (candidate, _) in _dtypes().items():
        if candidate == dtype:
            return name
    raise ValueError(f"torch dtype {dtype} has no safetensors equivalent")
