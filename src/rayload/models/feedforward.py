"""Feed-forward blocks: the gated MLP (Llama's SwiGLU), Mixtral's expert and the sparse
mixture of experts with its router.

The router is replicated and the hidden states are too (attention ends in an all-reduce),
so every rank routes every token the same way. The experts are shared among the ranks in
one of two ways (:attr:`~rayload.models.layers.TensorParallel.expert_parallel`):

* tensor parallel: every rank holds every expert's slice (its gate / up rows and its down
  columns), like a dense MLP, and computes its partial product of every chosen expert;
* expert parallel (vLLM's convention): rank ``r`` of ``tp`` holds experts
  ``[r*E/tp, (r+1)*E/tp)`` whole, under their global ids (``experts.5`` is expert 5 on
  whichever rank holds it), and computes their full output for the tokens routed to them.

Either way each rank's term is the sum of its experts' outputs weighted by the router
probabilities (plus its slice of the shared expert's, for Qwen2-MoE, which is split like
a dense MLP in both cases), and the block does one all-reduce: the sum over ranks is the
whole block's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from rayload.models.config import Activation, per_rank
from rayload.models.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TensorParallel,
    empty_param,
)


class Expert(nn.Module):
    """A feed-forward block whose rank-local term can be summed with others before one
    all-reduce."""

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output, before the all-reduce (no row-parallel bias)."""
        raise NotImplementedError


class GatedMLP(Expert):
    """``down(act(gate(x)) * up(x))`` with gate and up stacked as ``gate_up_proj``: the
    rank's gate rows then its up rows (``[2 * I / tp, hidden]``); ``down_proj`` holds the
    rank's columns and is all-reduced."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        act: Activation,
        *,
        bias: bool = False,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        local = per_rank(intermediate_size, tp.size, "intermediate_size")
        self.act = act
        self.gate_up_proj = ColumnParallelLinear(hidden_size, 2 * local, bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(local, hidden_size, tp, bias=bias, dtype=dtype)

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.act(gate) * up

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.partial(self._inner(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._inner(x))


class MixtralExpert(Expert):
    """One Mixtral expert under its checkpoint names: ``w2(act(w1 x) * w3 x)``, w1 / w3 the
    rank's rows, w2 its columns."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        act: Activation,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        local = per_rank(intermediate_size, tp.size, "intermediate_size")
        self.act = act
        self.w1 = ColumnParallelLinear(hidden_size, local, bias=False, dtype=dtype)
        self.w3 = ColumnParallelLinear(hidden_size, local, bias=False, dtype=dtype)
        self.w2 = RowParallelLinear(local, hidden_size, tp, bias=False, dtype=dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2.partial(self.act(self.w1(x)) * self.w3(x))


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts configuration, read from ``config.json`` by the architecture.

    ``normalize_top_k``: the chosen experts' softmax weights are rescaled to sum to 1
    (Mixtral always, Qwen-MoE when ``norm_topk_prob``). ``shared_intermediate_size``: the
    size of Qwen2-MoE's gated shared expert (0: none). Layer ``i`` is sparse unless it is in
    ``dense_layers`` or ``(i + 1) % sparse_step`` is not 0 (Qwen's ``mlp_only_layers`` and
    ``decoder_sparse_step``); a dense layer has the config's dense :class:`GatedMLP`.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    mixtral_experts: bool = False
    shared_intermediate_size: int = 0
    sparse_step: int = 1
    dense_layers: frozenset[int] = field(default_factory=frozenset)

    def is_sparse(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.dense_layers
            and (layer + 1) % self.sparse_step == 0
        )


class Router(nn.Module):
    """The replicated router ``weight [num_experts, hidden]``: softmax over experts in
    float32, then the top k, renormalized if the spec says so."""

    def __init__(self, hidden_size: int, spec: MoeSpec, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.normalize = spec.normalize_top_k
        self.weight = empty_param(spec.num_experts, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For tokens ``x [tokens, hidden]``: the top-k weights (in ``x``'s dtype) and the
        expert indices, both ``[tokens, top_k]``."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class SparseMoe(nn.Module):
    """The sparse MoE block: ``gate`` (the router), ``experts.E`` for the rank's experts
    (all of them split, or under expert parallel its block of them whole; ``E`` is always
    the global id), and for Qwen2-MoE the ``shared_expert`` weighted by
    ``sigmoid(shared_expert_gate(x))`` (gate replicated)."""

    def __init__(
        self,
        hidden_size: int,
        spec: MoeSpec,
        tp: TensorParallel,
        act: Activation,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(hidden_size, spec, dtype=dtype)
        expert = MixtralExpert if spec.mixtral_experts else GatedMLP
        whole = TensorParallel() if tp.expert_parallel else tp
        self.experts = nn.ModuleDict(
            {
                str(index): expert(hidden_size, spec.intermediate_size, whole, act, dtype=dtype)
                for index in tp.local_experts(spec.num_experts)
            }
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(
                hidden_size, spec.shared_intermediate_size, tp, act, dtype=dtype
            )
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        weights, chosen = self.gate(x)
        out = torch.zeros_like(x)
        for key, expert in cast("dict[str, Expert]", dict(self.experts)).items():
            tokens, slot = torch.where(chosen == int(key))
            if tokens.numel():
                term = expert.partial(x[tokens]) * weights[tokens, slot, None]
                out.index_add_(0, tokens, term)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
        return self.tp.all_reduce(out).view_as(hidden)
