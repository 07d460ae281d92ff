from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rayload.errors import CheckpointError
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.dtypes import DTYPES, ITEMSIZE, itemsize, safetensors_dtype, torch_dtype

TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def test_table_agrees_with_safetensors_library(tmp_path: Path) -> None:
    tensors = {str(d): torch.zeros(3, 2, dtype=d) for d in TORCH_DTYPES}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    infos = open_checkpoint(tmp_path).tensors
    for dtype in TORCH_DTYPES:
        info = infos[str(dtype)]
        assert torch_dtype(info.dtype) == dtype
        assert safetensors_dtype(dtype) == info.dtype
        assert ITEMSIZE[info.dtype] == dtype.itemsize
        assert DTYPES[info.dtype] == (dtype, dtype.itemsize)


def test_unknown_dtype_names_file_and_tensor() -> None:
    with pytest.raises(CheckpointError, match="dtype 'Q4'") as info:
        itemsize("Q4", file="/x/model.safetensors", tensor="w")
    assert (info.value.file, info.value.tensor) == ("/x/model.safetensors", "w")
    assert "/x/model.safetensors" in str(info.value) and "'w'" in str(info.value)
