"""An engine that fills its parameters the way vLLM's weight loaders do, for the dry-run
tests (rayload.integrations.dryrun; vLLM's own loaders drive it in tests/vllm).

:class:`LoaderLlama` is the rank's :class:`~support.toy_llama.ToyLlama` with a
``load_weights(weights)`` that takes each checkpoint tensor *whole* (of its full shape:
a :class:`~rayload.integrations.partial.PartialTensor` where the rank holds part of it)
and copies the rank's part into its parameter as vLLM's layers do: ``q/k/v_proj`` into
their rows of the stacked ``qkv_proj`` (KV heads fewer than tp: the rank's replica),
``gate/up_proj`` into their halves of ``gate_up_proj``, ``o_proj``/``down_proj`` cut on
dimension 1, the vocabulary cut on dimension 0, norms whole. ``convert`` names tensors
whose loader computes (``w * 1``) instead of copying; ``strided`` names tensors copied
into a strided region (a column block of a wider parameter): the two fallbacks a dry run
must see. Returns the names of the parameters it loaded, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from support.toy_llama import ToyLlama


class LoaderLlama(ToyLlama):
    def __init__(
        self,
        config: Mapping[str, Any],
        tp: int,
        rank: int,
        dtype: torch.dtype,
        *,
        convert: frozenset[str] = frozenset(),
        strided: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(config, tp, dtype)
        self.config, self.tp, self.rank = dict(config), tp, rank
        self.convert, self.strided = convert, strided
        # Two rows of a norm's width: the left half of both is a strided region.
        self.wide = nn.Parameter(torch.zeros(2, config["hidden_size"], dtype=dtype), False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            target, rows, part = self._place(name, weight)
            if name in self.strided:  # a norm's weight as the left half of both rows
                target = "wide"
                dest = params[target].data[:, : weight.shape[0] // 2]
                part = part.reshape(2, -1)
            else:
                dest = params[target].data.narrow(0, rows[0], rows[1])
            dest.copy_(part * 1 if name in self.convert else part)
            loaded.add(target)
        return loaded

    def _place(self, name: str, weight: torch.Tensor) -> tuple[str, tuple[int, int], Any]:
        """``(parameter, (first row, rows) of it, the rank's part of weight)``."""
        c, tp, rank = self.config, self.tp, self.rank
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        q_rows = c["num_attention_heads"] // tp * head_dim
        kv_heads = c["num_key_value_heads"]
        kv_rows = max(kv_heads // tp, 1) * head_dim
        inter = c["intermediate_size"] // tp
        prefix, _, leaf = name.rpartition(".")
        module = prefix.rpartition(".")[2]
        if module in ("q_proj", "k_proj", "v_proj"):
            qkv = prefix.rpartition(".")[0] + ".qkv_proj.weight"
            if module == "q_proj":
                return qkv, (0, q_rows), weight.narrow(0, rank * q_rows, q_rows)
            kv_rank = rank // max(tp // kv_heads, 1)
            offset = q_rows + (kv_rows if module == "v_proj" else 0)
            return qkv, (offset, kv_rows), weight.narrow(0, kv_rank * kv_rows, kv_rows)
        if module in ("gate_proj", "up_proj"):
            stacked = prefix.rpartition(".")[0] + ".gate_up_proj.weight"
            offset = inter if module == "up_proj" else 0
            return stacked, (offset, inter), weight.narrow(0, rank * inter, inter)
        if module in ("o_proj", "down_proj"):
            cols = weight.shape[1] // tp
            return name, (0, weight.shape[0]), weight.narrow(1, rank * cols, cols)
        if module in ("embed_tokens", "lm_head"):
            rows = weight.shape[0] // tp
            return name, (0, rows), weight.narrow(0, rank * rows, rows)
        assert leaf == "weight", name
        return name, (0, weight.shape[0]), weight
