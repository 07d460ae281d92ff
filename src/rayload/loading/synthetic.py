"""Synthetic Llama and Mixtral checkpoints for tests, demos and benchmarks.

:func:`write_checkpoint` writes real Hugging Face tensor names, a ``config.json`` and a
``model.safetensors.index.json`` over several shard files, in the safetensors format
(written here, so rayload needs no safetensors package at run time). Tensor data is
streamed in bounded chunks from a fast seeded generator, so a multi-GB checkpoint costs
little memory and about the disk's write time; the same seed gives the same bytes.

Values are random bit patterns with the top exponent bit cleared: finite (no NaN or inf,
so bit-identical comparisons with ``torch.equal`` work) and of magnitude below 2.
"""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from rayload.errors import ConfigError
from rayload.loading.checkpoint import CONFIG_NAME, INDEX_NAME
from rayload.loading.dtypes import ITEMSIZE
from rayload.loading.output import writing_to

log = logging.getLogger(__name__)

GB = 1_000_000_000
FILE_TARGET_BYTES = 256 * 1024 * 1024
"""Default shard file size: the file count is total size / this, at least 2."""

_CHUNK_WORDS = 1 << 21  # 16 MiB of random 64-bit words per write

DTYPES: dict[str, str] = {"bf16": "BF16", "f16": "F16", "f32": "F32"}
"""The ``dtype`` choices of :func:`write_checkpoint` -> their safetensors dtype."""
_FLOAT_DTYPES = DTYPES  # the former private name, still imported by rayload.cli
# Clears the top exponent bit of every element packed in a 64-bit word: |value| < 2.
_FINITE_MASK = {
    "BF16": 0xBFFF_BFFF_BFFF_BFFF,
    "F16": 0xBFFF_BFFF_BFFF_BFFF,
    "F32": 0xBFFF_FFFF_BFFF_FFFF,
}
_TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama decoder, as in its Hugging Face config.json."""

    _architecture: ClassVar[str] = "LlamaForCausalLM"
    _model_type: ClassVar[str] = "llama"

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor, in Hugging Face order."""
        h, kv_rows = self.hidden_size, self.num_key_value_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [
            ("model.embed_tokens.weight", (self.vocab_size, h))
        ]
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            out += [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv_rows, h)),
                (p + "self_attn.v_proj.weight", (kv_rows, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                *self._feed_forward(p),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        return out

    def _feed_forward(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        """The MLP tensors of the layer whose names start with ``prefix``."""
        h, i = self.hidden_size, self.intermediate_size
        return [
            (prefix + "mlp.gate_proj.weight", (i, h)),
            (prefix + "mlp.up_proj.weight", (i, h)),
            (prefix + "mlp.down_proj.weight", (h, i)),
        ]

    def config(self, dtype: str) -> dict[str, Any]:
        """A Hugging Face ``config.json`` for this shape stored in ``dtype`` (safetensors)."""
        return {
            "architectures": [self._architecture],
            "model_type": self._model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": _TORCH_DTYPE_NAMES[dtype],
        }


@dataclass(frozen=True)
class MixtralShape(LlamaShape):
    """A Mixtral decoder: Llama's attention and norms, and in place of the MLP a router
    (``block_sparse_moe.gate``) over ``num_local_experts`` experts, each three matrices
    (``w1`` gate and ``w3`` up: intermediate x hidden, ``w2`` down: hidden x
    intermediate), of which ``num_experts_per_tok`` run per token."""

    _architecture: ClassVar[str] = "MixtralForCausalLM"
    _model_type: ClassVar[str] = "mixtral"

    num_local_experts: int
    num_experts_per_tok: int

    def _feed_forward(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        h, i, moe = self.hidden_size, self.intermediate_size, prefix + "block_sparse_moe."
        out: list[tuple[str, tuple[int, ...]]] = [
            (moe + "gate.weight", (self.num_local_experts, h))
        ]
        for expert in range(self.num_local_experts):
            e = f"{moe}experts.{expert}."
            out += [(e + "w1.weight", (i, h)), (e + "w2.weight", (h, i)), (e + "w3.weight", (i, h))]
        return out

    def config(self, dtype: str) -> dict[str, Any]:
        return {
            **super().config(dtype),
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.02,
        }


PRESETS: dict[str, LlamaShape] = {
    # A few MB; every split dimension divisible by 8, so TP 1, 2, 4 and 8 all work.
    "tiny-llama": LlamaShape(512, 256, 512, 2, 8, 4, tie_word_embeddings=False),
    # Llama-3.2-1B's real shapes: 2.47 GB in bf16.
    "llama-1b": LlamaShape(128256, 2048, 8192, 16, 32, 8, tie_word_embeddings=True),
    # Mixtral's names and layout in about 13 MB: 8 experts, top 2, GQA (8 heads, 4 KV).
    "tiny-mixtral": MixtralShape(512, 256, 512, 2, 8, 4, False, 8, 2),
    # Mixtral-8x7B's layout at a quarter of its width: vocabulary 32000, 8 experts (top 2)
    # of intermediate / hidden = 3.5, GQA 4:1 (16 heads of 64, 4 KV heads), 32 layers;
    # 181 MB per layer in bf16, 97% of it experts' (5.9 GB; scale it with size_gb).
    "mixtral-8e": MixtralShape(32000, 1024, 3584, 32, 16, 4, False, 8, 2),
}


def preset_shape(preset: str, *, size_gb: float | None = None, dtype: str = "bf16") -> LlamaShape:
    """The shape of ``preset``, with the layer count scaled so the checkpoint is about
    ``size_gb`` GB (10^9 bytes) in ``dtype``; at least one layer."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    shape = PRESETS[preset]
    if size_gb is None:
        return shape
    if not size_gb > 0:
        raise ConfigError(f"size_gb must be positive, got {size_gb}")
    itemsize = ITEMSIZE[_st_dtype(dtype)]
    base = replace(shape, num_hidden_layers=0)
    fixed = sum(math.prod(s) for _, s in base.tensors()) * itemsize
    per_layer = sum(math.prod(s) for _, s in replace(shape, num_hidden_layers=1).tensors())
    per_layer = per_layer * itemsize - fixed
    layers = max(1, round((size_gb * GB - fixed) / per_layer))
    return replace(shape, num_hidden_layers=layers)


def write_checkpoint(
    out: str | os.PathLike[str],
    *,
    preset: str = "tiny-llama",
    size_gb: float | None = None,
    dtype: str = "bf16",
    num_files: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a synthetic checkpoint of ``preset`` (one of :data:`PRESETS`; Hugging Face
    index layout) into directory ``out`` and return its path.

    ``dtype`` is ``"bf16"``, ``"f16"`` or ``"f32"``; ``num_files`` defaults to one file per
    256 MiB, at least 2. ``out`` may exist but must not already hold a checkpoint.
    """
    st_dtype = _st_dtype(dtype)
    shape = preset_shape(preset, size_gb=size_gb, dtype=dtype)
    itemsize = ITEMSIZE[st_dtype]
    tensors = [(name, dims, math.prod(dims) * itemsize) for name, dims in shape.tensors()]
    total = sum(nbytes for _, _, nbytes in tensors)
    if num_files is None:
        num_files = max(2, math.ceil(total / FILE_TARGET_BYTES))
    if not 1 <= num_files <= len(tensors):
        raise ConfigError(
            f"num_files must be between 1 and {len(tensors)} (the tensor count) for this "
            f"model, got {num_files}"
        )
    root = Path(out)
    groups = _partition([nbytes for _, _, nbytes in tensors], num_files)
    with writing_to(root):
        _empty_dir(root)
        existing = set(root.iterdir())
    written: list[Path] = []
    try:
        with writing_to(root):
            weight_map: dict[str, str] = {}
            for number, (lo, hi) in enumerate(groups, start=1):
                file_name = f"model-{number:05d}-of-{num_files:05d}.safetensors"
                written.append(root / file_name)
                _write_file(root / file_name, tensors[lo:hi], st_dtype, seed)
                weight_map.update((name, file_name) for name, _, _ in tensors[lo:hi])
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            written.append(root / INDEX_NAME)
            (root / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            written.append(root / CONFIG_NAME)
            (root / CONFIG_NAME).write_text(json.dumps(shape.config(st_dtype), indent=2) + "\n")
    except BaseException:
        _remove_written([p for p in written if p not in existing])
        raise
    return root


def _st_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _empty_dir(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} exists and is not a directory; choose another output path")
    if root.is_dir() and any(
        p.suffix == ".safetensors" or p.name == INDEX_NAME for p in root.iterdir()
    ):
        raise ConfigError(f"{root} already holds a checkpoint; choose an empty directory")
    root.mkdir(parents=True, exist_ok=True)


def _remove_written(paths: list[Path]) -> None:
    """Undo a failed write: remove the files this call created (or began to)."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove %s after the failed write: %s", path, exc)


def _partition(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut ``sizes`` (in order) into ``parts`` non-empty contiguous groups of about equal
    bytes; returns [lo, hi) index pairs."""
    total, acc, lo = sum(sizes), 0, 0
    bounds: list[tuple[int, int]] = []
    for index, size in enumerate(sizes):
        acc += size
        groups_left = parts - len(bounds) - 1
        items_left = len(sizes) - index - 1
        if groups_left == 0:
            break
        if acc >= total * (len(bounds) + 1) / parts or items_left == groups_left:
            bounds.append((lo, index + 1))
            lo = index + 1
    bounds.append((lo, len(sizes)))
    return bounds


def _write_file(
    path: Path, tensors: list[tuple[str, tuple[int, ...], int]], dtype: str, seed: int
) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims, nbytes in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": list(dims),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, _, nbytes in tensors:
            for chunk in _random_bytes(nbytes, dtype, seed, name):
                f.write(chunk)


def _random_bytes(nbytes: int, dtype: str, seed: int, name: str) -> Iterator[memoryview]:
    """``nbytes`` of finite random ``dtype`` values for tensor ``name``, in chunks."""
    generator = np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))
    mask = np.uint64(_FINITE_MASK[dtype])
    left = nbytes
    while left > 0:
        words = generator.random_raw(min(_CHUNK_WORDS, -(-left // 8)))
        words &= mask
        chunk = words.view(np.uint8).data[: min(left, words.nbytes)]
        left -= len(chunk)
        yield chunk
