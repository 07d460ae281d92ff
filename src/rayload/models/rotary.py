"""Rotary position embedding (RoPE) as transformers computes it, from ``config.json``.

The inverse frequencies are a pure function of the config, so :class:`Rotary` is a frozen
value and cos / sin are computed in ``forward`` for positions ``0..seq-1``: no buffer
exists that building on the meta device would leave empty.

Supported ``rope_type``: ``default``, ``linear`` and ``llama3``; anything else (``dynamic``,
``yarn``, ``longrope``, ...) raises :class:`UnsupportedModelError` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rayload.models.config import UnsupportedModelError

_DEFAULT_THETA = 10_000.0
_SUPPORTED = ("default", "linear", "llama3")


def _rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE settings in transformers 5's ``rope_parameters`` form, also from the older
    ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", _DEFAULT_THETA))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return params


def _llama3_scaling(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent interpolation (transformers'
    ``_compute_llama3_parameters``): long wavelengths divided by ``factor``, short kept,
    the band between smoothly blended."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class Rotary:
    """RoPE of one model: ``dim`` rotated channels of each head (``head_dim`` times
    ``partial_rotary_factor``), the rest passed through unchanged."""

    dim: int
    theta: float
    rope_type: str = "default"
    params: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.rope_type not in _SUPPORTED:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not implemented; supported: {_SUPPORTED}"
            )
        if self.dim % 2:
            raise UnsupportedModelError(f"rotary dimension {self.dim} is odd")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], head_dim: int) -> Rotary:
        params = _rope_parameters(config)
        dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        return cls(dim, float(params["rope_theta"]), str(params["rope_type"]), params)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The ``dim / 2`` inverse frequencies, float32."""
        exponent = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.theta ** (exponent / self.dim))
        if self.rope_type == "linear":
            return inv_freq / float(self.params["factor"])
        if self.rope_type == "llama3":
            return _llama3_scaling(inv_freq, self.params)
        return inv_freq

    def cos_sin(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions ``0..seq_len-1``, shape ``[seq_len, dim]``, computed in
        float32 and cast to ``dtype`` (as transformers does)."""
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` ``[batch, heads, seq, head_dim]``
    (rotate-half style); the remaining channels pass through (partial rotary)."""
    dim = cos.shape[-1]
    rotated, passed = x[..., :dim], x[..., dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated
