"""A rank's shards under vLLM's head-aware convention, cut here from the full tensors,
and filling a reference model with them (the stacking rayload's filler does).

``convention_shards`` is the test's own statement of the convention, written without
``rayload.models``' arithmetic so the two check each other:

* q rows, whole heads: rank r's nh/tp heads; k / v rows: its nkv/tp heads, or with
  nkv < tp the one head ``r // (tp // nkv)``; o columns in the rank's q heads;
* gate / up (w1 / w3) rows, down (w2) columns; Phi-3's fused tensors per component;
* vocab rows of the embedding and LM head;
* GPT-2's Conv1D: ``c_attn`` columns per q / k / v component, ``c_fc`` columns,
  ``c_proj`` rows;
* everything else (norms, routers, o / down / c_proj biases, positions) whole.

Importable in spawned rank processes as ``models.shards`` (``tests/`` is on sys.path).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

Cut = Callable[[torch.Tensor, "_Layout"], torch.Tensor]


class _Layout:
    """Rank, tp size and the head sizes the cuts need, from config.json."""

    def __init__(self, config: Mapping[str, Any], rank: int, tp: int) -> None:
        self.rank, self.tp = rank, tp
        heads = config.get("num_attention_heads") or config["n_head"]
        hidden = config.get("hidden_size") or config["n_embd"]
        self.heads = int(heads)
        self.kv_heads = int(config.get("num_key_value_heads") or heads)
        self.head_dim = int(config.get("head_dim") or hidden // heads)

    def part(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The rank's 1/tp of ``t`` along ``dim``."""
        assert t.shape[dim] % self.tp == 0, (tuple(t.shape), dim, self.tp)
        return t.chunk(self.tp, dim)[self.rank]

    def kv(self, t: torch.Tensor) -> torch.Tensor:
        """The rank's kv head rows: split, or the one replicated head when nkv < tp."""
        if self.kv_heads >= self.tp:
            return self.part(t, 0)
        head = self.rank // (self.tp // self.kv_heads)
        return t[head * self.head_dim : (head + 1) * self.head_dim]


def _fused_qkv(t: torch.Tensor, lay: _Layout) -> torch.Tensor:
    q_rows, kv_rows = lay.heads * lay.head_dim, lay.kv_heads * lay.head_dim
    q, k, v = t.split([q_rows, kv_rows, kv_rows], dim=0)
    return torch.cat([lay.part(q, 0), lay.kv(k), lay.kv(v)], dim=0)


def _fused_halves(t: torch.Tensor, lay: _Layout) -> torch.Tensor:
    return torch.cat([lay.part(half, 0) for half in t.chunk(2, dim=0)], dim=0)


def _gpt2_qkv(t: torch.Tensor, lay: _Layout) -> torch.Tensor:
    dim = t.dim() - 1
    return torch.cat([lay.part(part, dim) for part in t.chunk(3, dim=dim)], dim=dim)


_RULES: list[tuple[str, Cut]] = [
    (r".*\.q_proj\.(weight|bias)", lambda t, lay: lay.part(t, 0)),
    (r".*\.(k_proj|v_proj)\.(weight|bias)", lambda t, lay: lay.kv(t)),
    (r".*\.o_proj\.weight", lambda t, lay: lay.part(t, 1)),
    (r".*\.self_attn\.qkv_proj\.weight", _fused_qkv),
    (r".*\.mlp\.gate_up_proj\.weight", _fused_halves),
    (r".*\.(gate_proj|up_proj|w1|w3)\.(weight|bias)", lambda t, lay: lay.part(t, 0)),
    (r".*\.(down_proj|w2)\.weight", lambda t, lay: lay.part(t, 1)),
    (r"(model\.embed_tokens|lm_head|transformer\.wte)\.weight", lambda t, lay: lay.part(t, 0)),
    (r".*\.attn\.c_attn\.(weight|bias)", _gpt2_qkv),
    (r".*\.mlp\.c_fc\.weight", lambda t, lay: lay.part(t, 1)),
    (r".*\.mlp\.c_fc\.bias", lambda t, lay: lay.part(t, 0)),
    (r".*\.(attn|mlp)\.c_proj\.weight", lambda t, lay: lay.part(t, 0)),
]


def read_config(path: Path) -> dict[str, Any]:
    return dict(json.loads((Path(path) / "config.json").read_text()))


def convention_shards(path: Path, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank`` of ``tp``'s tensors of the checkpoint at ``path``, by checkpoint name."""
    layout = _Layout(read_config(path), rank, tp)
    shards: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            cut = next((c for pattern, c in _RULES if re.fullmatch(pattern, name)), None)
            shards[name] = (cut(tensor, layout) if cut else tensor).contiguous()
    return shards


def stack_shards(
    tensors: Mapping[str, torch.Tensor], mapping: tuple[tuple[str, str, str], ...]
) -> dict[str, torch.Tensor]:
    """Apply a vLLM ``stacked_params_mapping``: each stacked parameter is the concatenation
    along dim 0 of its shards in the order the mapping lists them; other names unchanged."""
    order = {(param, shard_id): i for i, (param, _, shard_id) in enumerate(mapping)}
    stacked: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        row = next((r for r in mapping if r[1] in name), None)
        if row is None:
            out[name] = tensor
            continue
        param, shard, shard_id = row
        stacked.setdefault(name.replace(shard, param), []).append(
            (order[(param, shard_id)], tensor)
        )
    for name, parts in stacked.items():
        out[name] = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])], dim=0)
    return out


def fill(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """Replace every parameter of ``module`` (e.g. meta placeholders) by the tensor of the
    same name, without copying; a missing, extra or misshapen tensor is an AssertionError."""
    params = dict(module.named_parameters())
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    assert not missing and not extra, f"parameters without tensor {missing}, tensors extra {extra}"
    for name, tensor in tensors.items():
        param = params[name]
        assert param.shape == tensor.shape, (name, tuple(param.shape), tuple(tensor.shape))
        assert param.dtype == tensor.dtype, (name, param.dtype, tensor.dtype)
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))
    assert not any(b.is_meta for b in module.buffers()), "a buffer stayed on meta"
    return module
