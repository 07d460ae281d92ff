"""The contract of a reference model: what rayload's filler and the tests rely on.

A :class:`CausalLM` is a ``torch.nn.Module`` whose parameters hold ONE rank's shards under
vLLM's tensor-parallel convention and whose ``forward(input_ids)`` returns the full-vocab
logits on every rank. It is a reference, small and eager: causal attention over positions
``0..seq-1``, no KV cache, no padding mask, no sampling.

Parameter names are the checkpoint's tensor names, except that separate projections are
stacked as vLLM stacks them; :attr:`CausalLM.stacked_params_mapping` says how, in vLLM's
form ``(param_name_fragment, shard_name_fragment, shard_id)``: the parameter named with
``param_name_fragment`` in place of ``shard_name_fragment`` is the concatenation along
dimension 0 of the rank's shards of the listed tensors, in the order the mapping lists them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from rayload.models.config import UnsupportedModelError, check_sliding_window
from rayload.models.layers import TensorParallel

StackedParamsMapping = tuple[tuple[str, str, str], ...]
"""``(param_name_fragment, shard_name_fragment, shard_id)`` rows, vLLM's form."""

QKV_MAPPING: StackedParamsMapping = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
)
GATE_UP_MAPPING: StackedParamsMapping = (
    (".gate_up_proj", ".gate_proj", "0"),
    (".gate_up_proj", ".up_proj", "1"),
)


class CausalLM(nn.Module):
    """Base of the reference models: built from ``config.json`` for one rank.

    Construction allocates uninitialized parameters on the current default device, so
    ``with torch.device("meta"): model = cls(config, tp)`` costs no memory; every parameter
    is then replaced by the rank's shard (same name, same shape). ``forward`` checks its
    input once, then calls :meth:`_logits`.
    """

    stacked_params_mapping: ClassVar[StackedParamsMapping] = ()

    def __init__(self, config: Mapping[str, Any], tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = dict(config)
        self.tp = tp if tp is not None else TensorParallel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab_size]`` (full vocab, on every rank) for token ids
        ``[batch, seq]`` at positions ``0..seq-1``, causal."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise UnsupportedModelError(
                "input_ids must be an integer tensor [batch, seq], got "
                f"{input_ids.dtype} of shape {tuple(input_ids.shape)}"
            )
        check_sliding_window(self.config, input_ids.shape[1])
        return self._logits(input_ids)

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
