"""Real vLLM engines for the ``load_format="rayload"`` tests (tests/vllm), run in the test
process one after the other: what each generated, and what each of its workers holds.

:func:`run_engine` starts ``LLM(...)`` on a checkpoint at a TP size with one load format,
generates greedily for :data:`PROMPTS` in one call, asks every worker
:func:`worker_probe`, then (``reloads``) reloads the weights in place with vLLM's loader of
a load format, from a checkpoint, and generates again after each, and shuts the engine
down. The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
tests/vllm/conftest.py); TP 1's worker too, TP 2's two workers are spawned by vLLM's mp
executor. Workers import this module by name (spawned processes get this process's
``sys.path``, ``tests/`` included), so the probe travels to them as a reference.

An in-place reload is vLLM's own (``Worker.reload_weights``, the weight-update path of RL
frameworks): every parameter is loaded again from the loader's weights and vLLM's
post-processing runs again, so one engine answers for two loaders, and two engines'
start-ups (the TP 2 ones spawn workers that each import vLLM) become one.

Parameters are compared *before* vLLM's post-processing: on CPU
``process_weights_after_loading`` packs every linear layer's weight into a oneDNN handle
and leaves an empty ``weight`` behind, so a started engine's ``named_parameters`` hold
only embeddings, norms and biases. The probe therefore builds two fresh copies of the
worker's model (vLLM's ``initialize_model`` with the worker's config), fills every
parameter with NaN, loads one with ``load_format="auto"`` and one with
``load_format="rayload"``, and compares them byte for byte, in the worker, with the
worker's real TP group.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

PROMPTS = ([1, 2, 3, 4, 5], [17, 9, 101, 42], [150, 7, 7, 7, 7, 7, 60, 3], [88, 199])
MAX_TOKENS = 8
LOGPROBS = 2
ENGINE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 64,
    "max_num_seqs": len(PROMPTS),
    "seed": 0,
}
"""What every test engine shares; only ``load_format`` (and the TP size) differ."""


@dataclass(frozen=True)
class Reload:
    """An in-place reload of the engine's weights by vLLM's loader of ``load_format``,
    from ``checkpoint`` (None: the engine's own)."""

    load_format: str
    checkpoint: str | None = None


@dataclass(frozen=True)
class Answers:
    """Greedy answers to :data:`PROMPTS`: tokens and their top logprobs, per prompt.
    ``tensors_read``: after a :class:`Reload`, the tensors each worker's reload read."""

    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]]]
    tensors_read: list[int] | None = None


@dataclass(frozen=True)
class EngineRun:
    """One engine's greedy answers, its workers' probes (rank order), and its answers
    after each of its reloads (in order)."""

    load_format: str
    tp: int
    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]]]
    workers: list[dict[str, Any]]
    startup_s: float
    reloaded: tuple[Answers, ...] = ()
    expert_parallel: list[dict[str, Any]] | None = None
    variants: list[list[dict[str, Any]]] | None = None
    """Per worker (rank order), per variant asked: :func:`worker_variant_probe`."""

    @property
    def answers(self) -> Answers:
        """The answers of the engine as it started."""
        return Answers(self.tokens, self.logprobs)


def run_engine(
    checkpoint: str,
    tp: int,
    load_format: str,
    *,
    reloads: Sequence[Reload] = (),
    probe_expert_parallel: bool = False,
    variants: Sequence[Variant] = (),
    **engine: Any,
) -> EngineRun:
    """Start, generate, probe, reload and generate again, stop (see the module docstring).
    ``probe_expert_parallel``: the workers also compare fresh copies of the model built
    with vLLM's expert parallelism (:func:`worker_expert_parallel_probe`);
    ``variants``: fresh copies in other dtypes, from other checkpoints, with other
    options (:func:`worker_variant_probe`). Raises what
    ``LLM(...)`` raises, after cleaning up vLLM's process-wide state."""
    from vllm.distributed import cleanup_dist_env_and_memory

    from rayload.integrations.vllm import reload_in_place
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    try:
        llm = LLM(
            model=checkpoint,
            load_format=load_format,
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
            **{**ENGINE_ARGS, **engine},
        )
    except BaseException:
        gc.collect()
        cleanup_dist_env_and_memory()
        raise
    startup_s = time.perf_counter() - started
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)
        prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
        answers = _answers(llm.generate(prompts, params))
        workers = llm.collective_rpc(worker_probe, args=(load_format == "rayload",))
        expert_parallel = (
            llm.collective_rpc(worker_expert_parallel_probe) if probe_expert_parallel else None
        )
        variant_probes = (
            llm.collective_rpc(worker_variant_probe, args=(list(variants),)) if variants else None
        )
        reloaded = []
        for reload in reloads:
            read = llm.collective_rpc(reload_in_place, args=(reload.load_format, reload.checkpoint))
            # No answer may come from KV blocks the old weights computed.
            llm.reset_prefix_cache()
            again = _answers(llm.generate(prompts, params))
            reloaded.append(dataclasses.replace(again, tensors_read=read))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return EngineRun(
        load_format=load_format,
        tp=tp,
        tokens=answers.tokens,
        logprobs=answers.logprobs,
        workers=workers,
        startup_s=startup_s,
        reloaded=tuple(reloaded),
        expert_parallel=expert_parallel,
        variants=variant_probes,
    )


def _answers(outputs: Any) -> Answers:
    return Answers(
        tokens=[list(o.outputs[0].token_ids) for o in outputs],
        logprobs=[
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
            for o in outputs
        ],
    )


def worker_probe(worker: Any, compare: bool) -> dict[str, Any]:
    """Runs in each worker: its TP rank, its rayload load record (``last_load``), the
    bytes of vLLM's partition of the model for this rank, and (``compare``) the
    fresh-model comparison of the module docstring."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from rayload.integrations.vllm import last_load

    load = last_load()  # read first: the comparison below loads with rayload again
    probe: dict[str, Any] = {
        "rank": get_tensor_model_parallel_rank(),
        "load": None
        if load is None
        else {
            "rank": load.rank,
            "tp_size": load.tp_size,
            "shard_bytes": load.shard_bytes,
            "batches": load.batches,
            "read_chars": load.read_chars,
            "bytes_read": load.report.bytes_read,
            "method": load.report.method.effective.value,
            "storage": load.report.storage,
            "storage_bucket": load.report.storage_bucket,
            "direct_bytes": load.direct_bytes,
            "loader_bytes": load.loader_bytes,
            "unused_bytes": load.unused_bytes,
        },
    }
    if compare:
        auto, rayload = (_fresh_load(worker, fmt) for fmt in ("auto", "rayload"))
        probe["partition_bytes"] = _partition_bytes(auto)
        probe["compare"] = _compare(dict(auto.named_parameters()), dict(rayload.named_parameters()))
    return probe


def worker_expert_parallel_probe(worker: Any) -> dict[str, Any]:
    """Runs in each worker of a MoE engine: the fresh-model comparison of
    :func:`worker_probe` with vLLM's expert parallelism on for the two copies
    (``enable_expert_parallel``: each rank builds and loads whole experts, a contiguous
    block of them, instead of a slice of every one); also the shapes of the copies' expert
    parameters and whether rayload's load planned expert parallel."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from rayload.integrations.vllm import last_load

    parallel = worker.vllm_config.parallel_config
    parallel.enable_expert_parallel = True
    try:
        auto, rayload = (_fresh_load(worker, fmt) for fmt in ("auto", "rayload"))
    finally:
        parallel.enable_expert_parallel = False
    load = last_load()
    return {
        "rank": get_tensor_model_parallel_rank(),
        "rayload_expert_parallel": None if load is None else load.expert_parallel,
        "direct_bytes": None if load is None else load.direct_bytes,
        "shard_bytes": None if load is None else load.shard_bytes,
        "expert_shapes": {
            name: list(p.shape) for name, p in auto.named_parameters() if ".experts." in name
        },
        "compare": _compare(dict(auto.named_parameters()), dict(rayload.named_parameters())),
    }


@dataclass(frozen=True)
class Variant:
    """A fresh copy of a worker's model built in ``dtype`` and loaded from ``checkpoint``
    (None: the engine's), rayload's with ``extra`` added to the engine's
    ``model_loader_extra_config``."""

    checkpoint: str | None = None
    dtype: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def worker_variant_probe(worker: Any, variants: Sequence[Variant]) -> list[dict[str, Any]]:
    """Runs in each worker: per :class:`Variant`, the fresh-model comparison of
    :func:`worker_probe` for copies built and loaded so, and rayload's load record."""
    from rayload.integrations.vllm import last_load

    config = worker.vllm_config
    model_config, load_config = config.model_config, config.load_config
    results = []
    for variant in variants:
        saved = model_config.model, model_config.dtype, load_config.model_loader_extra_config
        model_config.model = variant.checkpoint or model_config.model
        model_config.dtype = getattr(torch, variant.dtype) if variant.dtype else model_config.dtype
        load_config.model_loader_extra_config = {**(saved[2] or {}), **variant.extra}
        try:
            auto, rayload = (_fresh_load(worker, fmt) for fmt in ("auto", "rayload"))
        finally:
            model_config.model, model_config.dtype, load_config.model_loader_extra_config = saved
        load = last_load()
        assert load is not None
        results.append(
            {
                "compare": _compare(
                    dict(auto.named_parameters()), dict(rayload.named_parameters())
                ),
                "shard_bytes": load.shard_bytes,
                "direct_bytes": load.direct_bytes,
                "loader_bytes": load.loader_bytes,
                "batches": load.batches,
            }
        )
    return results


def _fresh_load(worker: Any, load_format: str) -> torch.nn.Module:
    """A new copy of the worker's model, every parameter NaN, then loaded by vLLM's loader
    of ``load_format``. The new copy's attention layers register under the live model's
    names in vLLM's forward context, which is put back afterwards."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = worker.vllm_config
    context = config.compilation_config.static_forward_context
    live = dict(context)
    context.clear()
    try:
        with (
            set_current_vllm_config(config),
            set_default_torch_dtype(config.model_config.dtype),
            torch.device("cpu"),
        ):
            model = initialize_model(vllm_config=config, model_config=config.model_config)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
            # rayload's options are the engine's; vLLM's loaders refuse keys not theirs.
            extra = config.load_config.model_loader_extra_config if load_format == "rayload" else {}
            load_config = dataclasses.replace(
                config.load_config, load_format=load_format, model_loader_extra_config=extra
            )
            get_model_loader(load_config).load_weights(model, config.model_config)
    finally:
        context.clear()
        context.update(live)
    return model


def _compare(auto: dict[str, torch.Tensor], rayload: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Names, and per parameter whether its bytes are equal and whether any NaN is left."""
    return {
        "auto_names": sorted(auto),
        "rayload_names": sorted(rayload),
        "bytes": sum(p.numel() * p.element_size() for p in auto.values()),
        "differ": [
            name
            for name, p in auto.items()
            if name in rayload and not torch.equal(_raw(p), _raw(rayload[name]))
        ],
        "nan_left": [
            name
            for params in (auto, rayload)
            for name, p in params.items()
            if p.is_floating_point() and bool(torch.isnan(p).any())
        ],
    }


def _raw(p: torch.Tensor) -> torch.Tensor:
    return p.detach().contiguous().view(torch.uint8)


def _partition_bytes(model: torch.nn.Module) -> int:
    """Bytes of checkpoint data vLLM's parameters hold on this rank: every parameter
    (tied ones once), less the padding rows of its padded vocabulary."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    seen = set()
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            padding = module.num_embeddings_per_partition - module.shard_indices.num_org_elements
            total -= padding * module.embedding_dim * module.weight.element_size()
    return total
