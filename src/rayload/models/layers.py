"""Tensor-parallel building blocks: the rank's process group and the layers whose
parameters hold one rank's shards.

Each layer allocates its parameters with ``torch.empty`` on the current default device,
so building under ``with torch.device("meta")`` costs no memory and a loader can then
replace each parameter by the rank's shard tensor. All parameters have
``requires_grad=False``; nothing is computed in ``__init__`` that ``forward`` needs.

Communication happens in exactly three places, as in Megatron / vLLM:

* :class:`RowParallelLinear`: the partial products of the rank's input columns are
  summed over ranks (all-reduce), then the replicated bias is added once;
* :class:`VocabParallelEmbedding`: each rank looks up the ids in its vocab rows (zero
  elsewhere), then the rows are summed over ranks;
* :class:`ParallelLMHead`: each rank computes the logits of its vocab rows, then they are
  gathered along the last dimension into the full vocab.

With ``tp_size == 1`` none of them communicates. A mixture of experts
(``feedforward.SparseMoe``) sums its experts' terms before one all-reduce of its own,
whether its experts are split (tensor parallel) or divided whole among the ranks (expert
parallel, :attr:`TensorParallel.expert_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rayload.models.config import UnsupportedModelError, per_rank


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``, the ``torch.distributed`` group they form, and how the
    ranks share a mixture of experts.

    ``group`` None means torch's default group (the one ``init_process_group`` made); it
    is only consulted when ``size > 1``, so tp 1 needs no ``torch.distributed`` at all.
    ``expert_parallel`` False: every rank holds a slice of every expert (split like a dense
    MLP); True: the experts are divided among the ranks in contiguous blocks, each held
    whole (:meth:`local_experts`), as vLLM's ``enable_expert_parallel`` with the expert
    group equal to the tensor-parallel group. Only MoE layers consult it.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise UnsupportedModelError(f"rank {self.rank} of tp_size {self.size} is not a rank")

    def local_experts(self, num_experts: int) -> range:
        """The global ids of the experts this rank computes: all of them (each split), or
        under expert parallel ``[rank*E/size, (rank+1)*E/size)`` (each whole)."""
        if not self.expert_parallel:
            return range(num_experts)
        per = per_rank(num_experts, self.size, "num_experts (expert parallel)")
        return range(self.rank * per, (self.rank + 1) * per)

    def _check_group(self) -> None:
        if self.group is None and not dist.is_initialized():
            raise RuntimeError(
                f"rank {self.rank} of tp_size {self.size} needs a process group to combine "
                "its shards: pass one (ModelContext.process_group) or call "
                "torch.distributed.init_process_group first"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks (in place when communicating)."""
        if self.size == 1:
            return x
        self._check_group()
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        self._check_group()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A frozen parameter of ``shape``, uninitialized, on the current default device (meta
    under ``with torch.device("meta")``): a placeholder the loader replaces by a shard."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class ReplicatedLinear(nn.Module):
    """``y = x W^T`` with the whole W on every rank (routers, Qwen2-MoE's shared-expert gate)."""

    def __init__(self, input_size: int, output_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(output_size, input_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W the rank's rows ``[output_size_per_rank, input_size]``: the
    output stays split (the rank's heads, or its slice of the intermediate size)."""

    def __init__(
        self, input_size: int, output_size_per_rank: int, *, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = empty_param(output_size_per_rank, input_size, dtype=dtype)
        self.bias = empty_param(output_size_per_rank, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r W_r^T) + b`` with W the rank's columns
    ``[output_size, input_size_per_rank]`` and ``b`` replicated, added once."""

    def __init__(
        self,
        input_size_per_rank: int,
        output_size: int,
        tp: TensorParallel,
        *,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = empty_param(output_size, input_size_per_rank, dtype=dtype)
        self.bias = empty_param(output_size, dtype=dtype) if bias else None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum, without the bias (for callers that sum several
        partial terms before one all-reduce, like a mixture of experts)."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.partial(x))
        return y + self.bias if self.bias is not None else y


class Conv1DColumnParallel(nn.Module):
    """GPT-2's ``Conv1D`` (``y = x W + b``, W stored ``[in, out]``) with the rank's output
    columns: W ``[input_size, output_size_per_rank]``, b ``[output_size_per_rank]``."""

    def __init__(self, input_size: int, output_size_per_rank: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(input_size, output_size_per_rank, dtype=dtype)
        self.bias = empty_param(output_size_per_rank, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1
        )


class Conv1DRowParallel(nn.Module):
    """GPT-2's ``Conv1D`` with the rank's input rows: W ``[input_size_per_rank, output_size]``,
    partial products all-reduced, then the replicated bias ``[output_size]`` added once."""

    def __init__(
        self, input_size_per_rank: int, output_size: int, tp: TensorParallel, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = empty_param(input_size_per_rank, output_size, dtype=dtype)
        self.bias = empty_param(output_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(x @ self.weight) + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are the rank's vocab slice ``[r*V/tp, (r+1)*V/tp)``.

    Ids outside the slice give zero rows; the all-reduce then fills every position with
    the one rank's row that holds it.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        rows = per_rank(vocab_size, tp.size, "vocab_size")
        self.vocab_start = tp.rank * rows
        self.weight = empty_param(rows, hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside[..., None], 0.0))


class ParallelLMHead(nn.Module):
    """LM head whose rows are the rank's vocab slice; returns the full-vocab logits on
    every rank (all-gathered along the last dimension)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        rows = per_rank(vocab_size, tp.size, "vocab_size")
        self.weight = empty_param(rows, hidden_size, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return logits_from(hidden, self.weight, self.tp)


def logits_from(hidden: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Full-vocab logits from the rank's vocab rows ``weight`` (an LM head, or the embedding
    an LM head is tied to)."""
    return tp.all_gather_last(F.linear(hidden, weight))


class RMSNorm(nn.Module):
    """Llama's RMSNorm: the variance in float32, the weight applied in the input dtype."""

    def __init__(self, size: int, *, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` with replicated weight and bias (GPT-2's ``ln_*``)."""

    def __init__(self, size: int, *, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(size, dtype=dtype)
        self.bias = empty_param(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float
) -> torch.Tensor:
    """Causal softmax attention of ``q`` ``[batch, heads, seq, d]`` over ``k`` / ``v``
    ``[batch, kv_heads, seq, d]`` (each kv head serves ``heads / kv_heads`` consecutive q
    heads), the softmax in float32; returns ``[batch, seq, heads * d]``."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    seq = q.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, v).transpose(1, 2)
    return out.reshape(*out.shape[:2], -1)
