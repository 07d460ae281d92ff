"""Reading a ``config.json`` for the reference models: required fields, dtypes, activations,
the rank's share of attention heads and the checks that refuse what is not implemented.

Everything here is a pure function of the config dict (and rank / tp size): nothing is
computed from tensors, so the modules can be built on the meta device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rayload.errors import ConfigError
from rayload.loading.heads import HeadLayout

Activation = Callable[[torch.Tensor], torch.Tensor]


class UnsupportedModelError(ConfigError, ValueError):
    """The config asks for something the reference models do not implement (a RoPE type,
    an activation, cross-attention, a sequence past the sliding window) or that cannot be
    split over the tp size (heads, vocab or intermediate size not divisible).

    A ``ValueError`` as well as a rayload ``ConfigError``, so a caller catching either sees it.
    """


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``gelu_new``, written as transformers writes it (not ``F.gelu(approximate)``)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def _gelu_pytorch_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_pytorch_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
}
"""``hidden_act`` / ``activation_function`` names, with transformers' numerics."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def require(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, or an :class:`UnsupportedModelError` naming the missing key."""
    if key not in config or config[key] is None:
        raise UnsupportedModelError(f"config.json has no {key!r}, which the model needs")
    return config[key]


def activation(name: str) -> Activation:
    """The activation function called ``name`` in the config (``hidden_act``)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelError(
            f"activation {name!r} is not implemented; supported: {sorted(ACTIVATIONS)}"
        ) from None


def config_dtype(config: Mapping[str, Any]) -> torch.dtype:
    """The dtype the checkpoint's weights are stored in (``dtype``, formerly
    ``torch_dtype``), float32 when the config does not say."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    try:
        return _DTYPES[str(name)]
    except KeyError:
        raise UnsupportedModelError(
            f"config dtype {name!r} is not one of {sorted(_DTYPES)}"
        ) from None


def per_rank(size: int, tp_size: int, what: str) -> int:
    """``size // tp_size``, refusing a ``size`` that does not divide (no padding here)."""
    if size % tp_size:
        raise UnsupportedModelError(f"{what}={size} is not divisible by tp_size={tp_size}")
    return size // tp_size


@dataclass(frozen=True)
class AttentionHeads:
    """The attention heads of one rank under vLLM's head-aware convention.

    Rank ``r`` holds q heads ``[r*nh/tp, (r+1)*nh/tp)``. With ``nkv >= tp`` it holds kv
    heads ``[r*nkv/tp, (r+1)*nkv/tp)``; with ``nkv < tp`` (``tp % nkv == 0``) it holds one
    whole kv head, ``r // (tp // nkv)``, the one its q heads attend with (kv heads are
    replicated over ``tp // nkv`` ranks). A head is never cut.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp_size: int

    def __post_init__(self) -> None:
        per_rank(self.num_heads, self.tp_size, "num_attention_heads")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.num_kv_heads % self.tp_size and self.tp_size % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_key_value_heads={self.num_kv_heads} and tp_size={self.tp_size}: one must "
                "divide the other (kv heads are split, or replicated over tp/nkv ranks)"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any], tp_size: int) -> AttentionHeads:
        """Heads as the planner reads them (:class:`rayload.loading.heads.HeadLayout`):
        ``num_attention_heads`` (GPT-2: ``n_head``), ``num_key_value_heads`` (default: as
        many as q heads), ``head_dim`` (default ``hidden_size // num_attention_heads``)."""
        layout = HeadLayout.from_config(config)
        if layout is None:
            raise UnsupportedModelError(
                "config.json declares no attention heads the model can use: it needs "
                "num_attention_heads (or n_head) and head_dim or a hidden_size they divide"
            )
        return cls(layout.num_heads, layout.num_kv_heads, layout.head_dim, tp_size)

    @property
    def local_heads(self) -> int:
        """q heads on each rank."""
        return self.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        """kv heads on each rank: ``nkv / tp``, or 1 when kv heads are replicated."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def q_size(self) -> int:
        return self.local_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.local_kv_heads * self.head_dim


def tie_word_embeddings(config: Mapping[str, Any]) -> bool:
    """Whether the LM head reuses the embedding (transformers' default is untied for the
    Llama-style families, and the configs it writes always say)."""
    return bool(config.get("tie_word_embeddings", False))


def check_sliding_window(config: Mapping[str, Any], seq_len: int) -> None:
    """Refuse a sequence longer than a sliding window the config turns on.

    Sliding-window attention is not implemented; up to ``sliding_window`` tokens it equals
    full causal attention, so shorter sequences are exact. Whether the window is on follows
    transformers: ``layer_types`` if the config lists them, else ``use_sliding_window``
    (Qwen), else a set ``sliding_window`` (Mistral, Mixtral, Phi-3).
    """
    window = config.get("sliding_window")
    if not window or seq_len <= window:
        return
    if "layer_types" in config and config["layer_types"] is not None:
        on = "sliding_attention" in config["layer_types"]
    elif "use_sliding_window" in config:
        on = bool(config["use_sliding_window"])
    else:
        on = True
    if on:
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={window}) is not implemented: "
            f"sequences of up to {window} tokens are exact, this one has {seq_len}"
        )
