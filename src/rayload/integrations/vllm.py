"""vLLM's ``load_format="rayload"``: each vLLM worker reads only its own shard.

Registered in every vLLM process (engine and workers) by the ``vllm.general_plugins``
entry point ``rayload = rayload.integrations.vllm:register`` (``pip install rayload[vllm]``),
so ``LLM(..., load_format="rayload")`` and ``vllm serve ... --load-format rayload`` find it.
This module and its tracing (:mod:`rayload.integrations.vllm_trace`, which imports vLLM
only inside the functions that ask it something) are the only ones of rayload that import vLLM.

In each worker :meth:`RayloadModelLoader.load_weights`:

1. takes vLLM's TP rank and size (and, with ``enable_expert_parallel``, gives the rank its
   experts whole, as vLLM's linear expert placement does);
2. plans the checkpoint with rayload's planner (its sharding rules follow vLLM's
   conventions: whole heads, KV heads replicated, fused components), re-planning each
   vocabulary-parallel tensor to the rows vLLM's padded vocabulary gives the rank;
3. finds where each tensor of the rank's shard lands in vLLM's parameters by running
   vLLM's own ``model.load_weights`` on data-less stand-ins (a dry run,
   :mod:`~rayload.integrations.dryrun`): vLLM's weight loaders lay the tensors out as
   they always do (stacked ``qkv_proj`` / ``gate_up_proj``, GQA-replicated KV heads,
   padded vocabulary, tied embeddings, experts), and each ``copy_`` they would make is
   recorded instead: the region of the parameter it fills;
4. reads every tensor whose region is a plain one (one contiguous run of the parameter,
   the checkpoint's dtype, the load's device) straight into it with
   :func:`rayload.loading.rank.load_rank` (``into=``): one copy, from storage into the
   memory vLLM serves from;
5. hands the others (a dtype conversion, a loader that computes, a quantized model, a
   region that is not plain: :data:`~rayload.integrations.dryrun.REASONS`) to vLLM's
   weight loaders as :class:`~rayload.integrations.partial.PartialTensor` s, in batches
   of whole checkpoint files (:mod:`~rayload.integrations.batches`: about
   ``batch_bytes`` of the shard at a time beside the model), as the default loader does;
   ``strict`` refuses them, naming the tensor, the parameter and the reason. Any byte a
   loader wants that rayload did not plan is a :class:`~rayload.errors.ShardingError`
   naming the tensor, in the dry run, before anything is read. There is no fallback to
   vLLM's default loader.

rayload's options travel in ``model_loader_extra_config`` (:class:`VllmLoadOptions`).
Each worker's load joins one trace, with vLLM's own start-up spans where vLLM traces
(:mod:`rayload.integrations.vllm_trace`).

Past 400 lines on purpose: with :mod:`~rayload.integrations.vllm_trace` it is the only
module that imports vLLM, so everything that touches vLLM's objects (its configs, its
parallel state, its model and parameters) stays behind this one boundary.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from rayload.errors import CheckpointError, ConfigError
from rayload.integrations.batches import load_in_batches, merged_report
from rayload.integrations.dryrun import REASONS, Destinations, find_destinations, through_loaders
from rayload.integrations.partial import partial_tensor
from rayload.integrations.vllm_trace import WorkerTrace, secure_span_ids, trace_target
from rayload.loading.checkpoint import Checkpoint
from rayload.loading.model import MODEL_BUILD_PHASE, MODEL_FILL_PHASE
from rayload.loading.plan import RankPlan, TensorShard
from rayload.loading.plan_hf import tensor_shard
from rayload.loading.probe import read_chars
from rayload.loading.rank import load_rank, plan_rank
from rayload.loading.report import DESTINATIONS, PhaseTimer, RankReport
from rayload.loading.rules import Rule, RuleSet, resolve_rules
from rayload.loading.storage import is_remote

__all__ = [
    "LOAD_FORMAT",
    "RayloadModelLoader",
    "VllmLoadOptions",
    "WorkerLoad",
    "last_load",
    "register",
    "reload_in_place",
]

_vllm_log = init_logger("vllm.model_executor.model_loader.rayload")
"""vLLM's logger: the load's summary line appears among vLLM's own, like its loaders'."""

LOAD_FORMAT = "rayload"
"""vLLM's name of this load format (``load_format="rayload"``)."""

DESTINATIONS_PHASE = DESTINATIONS
"""The dry run of vLLM's weight loaders that finds where each tensor lands
(:mod:`~rayload.integrations.dryrun`): a phase of the worker's ``rank.load``."""

_OWN_MEMORY = frozenset({"fastsafetensors", "fastsafetensors_gdr", "dummy"})
"""Methods that load into buffers of their own: their tensors go through vLLM's weight
loaders (reading them into parameters would be the same copy, after a whole batch in
memory)."""


class VllmLoadOptions(BaseModel):
    """rayload's options in vLLM's ``model_loader_extra_config`` (unknown keys refused).

    ``method``: rayload's load method (``auto`` reads straight into vLLM's parameters
    with rayload's reader; ``fastsafetensors`` and ``dummy`` load into buffers of their
    own, which vLLM's weight loaders copy from). ``strict`` makes any fallback an error:
    of the method, or of a tensor to vLLM's weight loaders. ``device``: where rayload
    loads (default: vLLM's load device, where the parameters are; another one sends
    every tensor through the weight loaders).
    ``rules``: a sharding rules file for an architecture rayload has no preset for.
    ``trace_dir``: where the workers' spans are merged into rayload's trace files (they
    also go to vLLM's OTLP endpoint when it has one). ``path``: where the weights are, a
    checkpoint directory or ``s3://bucket/prefix`` (default: vLLM's model directory). vLLM
    0.32 takes an ``s3://`` model only with its own streaming formats, so an object-storage
    checkpoint is a local model directory (config.json, the tokenizer) plus ``path``.
    ``batch_bytes``: about the most bytes of the rank's shard loaded before vLLM's weight
    loaders copy them into its parameters and they are freed (whole checkpoint files at a
    time; 0: the whole shard at once), for the tensors that go through them: the load
    holds at most that much beside the model. ``direct``: read each tensor straight into
    its parameter where its region is a plain one (the default); False sends every tensor
    through vLLM's weight loaders, staged.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal[
        "auto", "scratch", "converted", "fastsafetensors", "fastsafetensors_gdr", "dummy"
    ] = "auto"
    device: str | None = None
    rules: str | None = None
    strict: bool = False
    trace_dir: str | None = None
    path: str | None = None
    batch_bytes: int = Field(default=1 << 30, ge=0)
    direct: bool = True

    @classmethod
    def parse(cls, extra: object) -> VllmLoadOptions:
        """The options from ``model_loader_extra_config`` (a dict; empty: the defaults);
        one ConfigError naming the key and the allowed keys when it is wrong."""
        if not isinstance(extra, Mapping):
            raise ConfigError(
                f"load_format={LOAD_FORMAT!r}: model_loader_extra_config must be a dict of "
                f"rayload options ({', '.join(cls.model_fields)}), got {type(extra).__name__}"
            )
        try:
            return cls.model_validate(dict(extra))
        except ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(p) for p in first["loc"]) or "model_loader_extra_config"
            raise ConfigError(
                f"load_format={LOAD_FORMAT!r}: model_loader_extra_config[{key!r}]: "
                f"{first['msg']} (rayload's options: {', '.join(cls.model_fields)})"
            ) from None


@dataclass(frozen=True)
class WorkerLoad:
    """What the last ``load_format="rayload"`` load did in this worker process.

    ``report`` is rayload's :class:`RankReport` (method, bytes, phases: every load's);
    ``shard_bytes`` the bytes of the rank's plan that vLLM takes (``direct_bytes`` of them
    read straight into its parameters, ``loader_bytes`` through its weight loaders, by
    reason: :data:`~rayload.integrations.dryrun.REASONS`); ``unused_bytes`` those of
    tensors no weight loader took, not read; ``batches`` how many loads of whole files
    the tensors through the weight loaders took (:mod:`~rayload.integrations.batches`; 0
    when none did); ``read_chars`` what the process read through ``read()``-family calls
    during the load (``rchar``; None off Linux): the rank's shard, its files' headers and
    config.json.
    """

    rank: int
    tp_size: int
    expert_parallel: bool
    report: RankReport
    shard_bytes: int
    batches: int
    read_chars: int | None
    seconds: float
    direct_bytes: int = 0
    loader_bytes: dict[str, int] = field(default_factory=dict)
    unused_bytes: int = 0


_last_load: WorkerLoad | None = None


def last_load() -> WorkerLoad | None:
    """This worker's last rayload load (None before one): for probes such as
    ``LLM.apply_model(lambda model: last_load())`` and the benchmark."""
    return _last_load


class RayloadModelLoader(BaseModelLoader):
    """vLLM's model loader for ``load_format="rayload"`` (module docstring)."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = VllmLoadOptions.parse(load_config.model_loader_extra_config)
        self._trace: WorkerTrace | None = None

    def download_model(self, model_config: ModelConfig) -> None:
        _checkpoint(model_config, self.options.path)

    def create_model(
        self, vllm_config: Any, model_config: ModelConfig, prefix: str = ""
    ) -> nn.Module:
        """vLLM's own model init, timed as ``rank.model.build`` of the worker's trace."""
        self._trace = WorkerTrace(trace_target(self.options.trace_dir))
        with self._trace.phase(MODEL_BUILD_PHASE):
            return super().create_model(vllm_config, model_config, prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        rank, tp_size, expert_parallel = _parallel_layout()
        trace = self._trace or WorkerTrace(trace_target(self.options.trace_dir))
        self._trace = None
        try:
            self._load_weights(model, model_config, rank, tp_size, expert_parallel, trace)
        except BaseException as exc:
            trace.finish(rank, tp_size, None, repr(exc))
            raise
        trace.finish(rank, tp_size, _last_load.report if _last_load else None, None)

    def _load_weights(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        rank: int,
        tp_size: int,
        expert_parallel: bool,
        trace: WorkerTrace,
    ) -> None:
        global _last_load
        start = time.perf_counter()
        start_ns = time.time_ns()
        chars_before = read_chars()
        options = self.options
        path = _checkpoint(model_config, options.path)
        vocab = _vocab_rows(model)
        device = options.device or _param_device(model)
        timer = PhaseTimer()
        checkpoint, plan = plan_rank(
            path,
            rank,
            tp_size,
            rules=_vllm_rules(options.rules, _architecture(model_config), vocab),
            expert_parallel=expert_parallel,
            adjust_plan=lambda plan, checkpoint: _vllm_vocab(plan, checkpoint, vocab),
            timer=timer,
        )
        with timer.phase(DESTINATIONS_PHASE) as attrs:
            routes = _destinations(model, model_config, plan, torch.device(device), options)
            attrs.update(_route_attributes(routes, plan))
        if options.strict:
            routes.refuse_fallbacks(rank)
        check = model_config.quantization is None
        if check and routes.loaded is not None:
            _check_all_loaded(model, routes.loaded, rank, path)
        direct, through_loaders = routes.split(plan)
        group = _tp_group(device) if is_remote(path) else None
        common: dict[str, Any] = {
            "method": options.method,
            "device": device,
            "strict": options.strict,
            "checkpoint": checkpoint,
            "timer": timer,
            "group": group,
        }
        _, report = load_rank(
            path, rank, tp_size, plan=direct, into=_direct_into(routes, direct), **common
        )
        reports = [report]
        if through_loaders.shards or group is not None:
            loaded = model.load_weights(  # type: ignore[operator]
                self._through_loaders(path, rank, tp_size, through_loaders, common, trace, reports)
            )
            if check and routes.loaded is None:
                _check_all_loaded(model, loaded, rank, path)
        chars_after = read_chars()
        seconds = time.perf_counter() - start
        report = dataclasses.replace(merged_report(reports), start_ns=start_ns)
        loader_bytes = routes.loader_bytes(plan)
        _last_load = WorkerLoad(
            rank=rank,
            tp_size=tp_size,
            expert_parallel=expert_parallel,
            report=report,
            shard_bytes=direct.nbytes + through_loaders.nbytes,
            batches=len(reports) - 1,
            read_chars=None
            if chars_before is None or chars_after is None
            else chars_after - chars_before,
            seconds=seconds,
            direct_bytes=direct.nbytes,
            loader_bytes=loader_bytes,
            unused_bytes=plan.nbytes - direct.nbytes - through_loaders.nbytes,
        )
        _vllm_log.info(
            "Loading weights took %.2f seconds (rayload, rank %d/%d: %d tensors, %d bytes; "
            "%d straight into vLLM's parameters, %d through its weight loaders%s; in %d "
            "batch(es) through them, %s, from %s)",
            seconds,
            rank,
            tp_size,
            report.tensors,
            report.bytes_read,
            direct.nbytes,
            through_loaders.nbytes,
            "".join(f"; {REASONS[r]}: {n}" for r, n in loader_bytes.items()),
            len(reports) - 1,
            report.method.effective.value,
            report.storage,
        )

    def _through_loaders(
        self,
        path: str,
        rank: int,
        tp_size: int,
        plan: RankPlan,
        common: dict[str, Any],
        trace: WorkerTrace,
        reports: list[RankReport],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The shards of ``plan`` for vLLM's ``load_weights``, in batches
        (:mod:`~rayload.integrations.batches`) one after the other, each read, then handed
        over and freed as vLLM copies it in; each batch's report goes to ``reports``."""
        batches = load_in_batches(
            path, rank, tp_size, self.options.batch_bytes, plan=plan, **common
        )
        for tensors, report, cut in batches:
            reports.append(report)
            with trace.phase(MODEL_FILL_PHASE):
                yield from _weights(tensors, {s.name: s for s in cut.shards}, rank)


def reload_in_place(worker: Any, load_format: str = LOAD_FORMAT, path: str | None = None) -> int:
    """In a vLLM worker (``llm.collective_rpc(reload_in_place, args=(fmt, path))``): reload
    its weights in place (vLLM's ``reload_weights``) with vLLM's loader of ``load_format``,
    from ``path`` (default: the model's); returns the tensors the loader handed over."""
    from vllm.config.load import LoadConfig as VllmLoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    runner = worker.model_runner
    model_config = runner.model_config
    loader = get_model_loader(VllmLoadConfig(load_format=load_format))
    original, model_config.model = model_config.model, path or model_config.model
    count = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for item in loader.get_all_weights(model_config, runner.get_model()):
            count += 1
            yield item

    try:
        worker.reload_weights(weights_iterator=counted())
    finally:
        model_config.model = original
    return count


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers ``load_format="rayload"`` (and
    makes vLLM's span ids in this process unique, :func:`secure_span_ids`)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not RayloadModelLoader:
        register_model_loader(LOAD_FORMAT)(RayloadModelLoader)
    secure_span_ids()


def _tp_group(device: str) -> Any:
    """vLLM's TP group for ``device``'s tensors (its gloo group for host ones): the workers
    of an engine reading object storage fetch each split-1 tensor once between them over
    it (``load_rank``'s ``group``), as rayload's own ranks do over the load's group."""
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    return tp.device_group if torch.device(device).type == "cuda" else tp.cpu_group


def _parallel_layout() -> tuple[int, int, bool]:
    """``(tp_rank, tp_size, expert_parallel)`` of this worker; ConfigError for a layout
    rayload does not plan (pipeline, data or context parallel)."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    parallel = get_current_vllm_config().parallel_config
    unsupported = {
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "prefill_context_parallel_size": getattr(parallel, "prefill_context_parallel_size", 1),
        "decode_context_parallel_size": getattr(parallel, "decode_context_parallel_size", 1),
    }
    for name, size in unsupported.items():
        if size != 1:
            raise ConfigError(
                f"load_format={LOAD_FORMAT!r} plans tensor-parallel ranks only; {name}={size} "
                f"is not supported (use another load format for it)"
            )
    expert_parallel = bool(parallel.enable_expert_parallel)
    if expert_parallel and (parallel.enable_eplb or parallel.expert_placement_strategy != "linear"):
        raise ConfigError(
            f"load_format={LOAD_FORMAT!r} gives each rank a contiguous block of experts "
            "(expert_placement_strategy='linear', no EPLB); got "
            f"{parallel.expert_placement_strategy!r}, eplb={parallel.enable_eplb}"
        )
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), expert_parallel


def _checkpoint(model_config: ModelConfig, path: str | None) -> str:
    """The checkpoint rayload reads: ``path`` (``s3://...`` or a directory), else vLLM's
    model directory; CheckpointError when a local one is not a directory."""
    checkpoint = path or str(model_config.model)
    if is_remote(checkpoint):
        return checkpoint
    if not os.path.isdir(checkpoint):
        where = "model_loader_extra_config['path']" if path else "the model"
        raise CheckpointError(
            f"load_format={LOAD_FORMAT!r} reads a checkpoint directory or s3://bucket/prefix; "
            f"{where} {checkpoint!r} is neither (download it first, e.g. `hf download`, and "
            "pass its path)",
            file=checkpoint,
        )
    return checkpoint


def _param_device(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return "cpu" if param is None else str(param.device)


def _vocab_rows(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Checkpoint name -> ``(start, length)`` of the vocabulary rows vLLM gives this rank,
    for every vocabulary-parallel parameter (vLLM pads the vocabulary to a multiple of 64
    and then cuts it evenly, so the last rank may hold fewer real rows)."""
    rows: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding):
            indices = module.shard_indices
            start = indices.org_vocab_start_index
            rows[f"{name}.weight"] = (start, indices.org_vocab_end_index - start)
    return rows


def _architecture(model_config: ModelConfig) -> str | None:
    architectures = getattr(model_config.hf_config, "architectures", None) or [None]
    return architectures[0]


def _vllm_rules(rules: str | None, architecture: str | None, vocab: Iterable[str]) -> RuleSet:
    """The rules to plan with (the ``rules`` file, else the architecture's preset) with
    every vocabulary-parallel tensor replicated after the user's own rules: vLLM pads the
    vocabulary before it cuts it, so its size need not divide by the TP size, and
    :func:`_vllm_vocab` then gives the rank vLLM's rows."""
    base = resolve_rules(rules, architecture)
    mine, preset = base.rules[: base.user_rules], base.rules[base.user_rules :]
    whole = tuple(Rule(re.escape(name), None) for name in vocab)
    return RuleSet((*mine, *whole, *preset), base.source, base.user_rules)


def _vllm_vocab(
    plan: RankPlan, checkpoint: Checkpoint, rows: Mapping[str, tuple[int, int]]
) -> RankPlan:
    """The rank's plan with each vocabulary tensor cut on dimension 0 as vLLM cuts it
    (``rows``)."""
    shards = []
    for shard in plan.shards:
        piece = rows.get(shard.name)
        if piece is not None and (shard.split, shard.pieces) != (0, (piece,)):
            shard = tensor_shard(checkpoint.tensors[shard.name], 0, (piece,))
        shards.append(shard)
    return RankPlan(plan.rank, plan.tp_size, tuple(shards))


def _weights(
    tensors: dict[str, torch.Tensor], shards: Mapping[str, TensorShard], rank: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for vLLM's ``load_weights``, each of its full shape; a shard is
    dropped from ``tensors`` as it is handed over so its memory goes once vLLM copied it."""
    for name in list(tensors):
        shard, data = shards[name], tensors.pop(name)
        yield (
            name,
            partial_tensor(name, shard.full_shape, shard.split, shard.pieces, data, rank=rank),
        )


def _destinations(
    model: nn.Module,
    model_config: ModelConfig,
    plan: RankPlan,
    device: torch.device,
    options: VllmLoadOptions,
) -> Destinations:
    """Where each shard of ``plan`` goes: the dry run of vLLM's weight loaders, or every
    shard through them when the model is quantized (vLLM's loaders and its online
    quantization repack as they load) or the method loads into memory of its own."""
    if model_config.quantization is not None:
        why = f"the model is quantized ({model_config.quantization}); vLLM's loaders repack it"
        return through_loaders(plan, "quantized", why)
    if options.method in _OWN_MEMORY:
        why = f"method {options.method} loads into buffers of its own"
        return through_loaders(plan, "method", why)
    if not options.direct:
        return through_loaders(plan, "off", "model_loader_extra_config direct=False")
    names: dict[int, str] = {}
    for kind in (model.named_parameters(), model.named_buffers()):
        for name, tensor in kind:
            if tensor.numel():
                names.setdefault(tensor.untyped_storage().data_ptr(), name)

    def parameter_of(dest: torch.Tensor) -> tuple[str, str | None]:
        return names.get(dest.untyped_storage().data_ptr(), "an unnamed tensor"), None

    return find_destinations(
        model.load_weights,  # type: ignore[arg-type]
        plan,
        device=device,
        parameter_of=parameter_of,
    )


def _direct_into(routes: Destinations, direct: RankPlan) -> dict[str, torch.Tensor]:
    return {shard.name: routes.direct[shard.name] for shard in direct.shards}


def _route_attributes(routes: Destinations, plan: RankPlan) -> dict[str, Any]:
    """``rank.destinations``' attributes: tensors and bytes straight into the parameters,
    through the weight loaders (by reason) and unused."""
    direct, loaders = routes.split(plan)
    attrs: dict[str, Any] = {
        "destinations.dry_run": routes.loaded is not None,
        "destinations.direct_tensors": len(direct.shards),
        "destinations.direct_bytes": direct.nbytes,
        "destinations.loader_tensors": len(loaders.shards),
        "destinations.loader_bytes": loaders.nbytes,
        "destinations.unused_tensors": len(routes.unused),
    }
    for reason, nbytes in routes.loader_bytes(plan).items():
        attrs[f"destinations.loader_bytes.{reason}"] = nbytes
    if routes.through_loaders:
        first = next(iter(routes.through_loaders.values()))
        attrs["destinations.first_fallback"] = first.describe()
    return attrs


def _check_all_loaded(model: nn.Module, loaded: Any, rank: int, path: str) -> None:
    """CheckpointError naming the first parameter vLLM's ``load_weights`` did not fill."""
    if loaded is None:
        return
    missing = [name for name, _ in model.named_parameters() if name not in loaded]
    if missing:
        raise CheckpointError(
            f"rank {rank}: {path}: no checkpoint tensor filled vLLM's parameter "
            f"{missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            file=path,
            tensor=missing[0],
        )
