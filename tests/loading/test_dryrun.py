"""rayload.integrations.dryrun: where each tensor of a rank's shard lands in an engine's
parameters, found by running the engine's own weight loaders on stand-ins, then read
straight there (``load_rank(into=...)``). The engine is support.weight_loaders'
vLLM-style :class:`LoaderLlama`; vLLM's own loaders drive the same code in tests/vllm.

The reference for every parameter is the same engine filled the way it was before the
dry run existed: the rank's shards read into buffers, handed to its weight loaders as
partial tensors, copied in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rayload.errors import CheckpointError, MethodUnavailableError, ShardingError
from rayload.integrations.dryrun import Destinations, find_destinations
from rayload.integrations.partial import partial_tensor
from rayload.loading.checkpoint import Checkpoint
from rayload.loading.plan import RankPlan
from rayload.loading.rank import load_rank, plan_rank
from support.weight_loaders import LoaderLlama

CPU = torch.device("cpu")


def _config(path: Path) -> dict[str, int]:
    return json.loads((path / "config.json").read_text())


def _engine(path: Path, tp: int, rank: int, dtype: torch.dtype, **kwargs: object) -> LoaderLlama:
    engine = LoaderLlama(_config(path), tp, rank, dtype, **kwargs)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in engine.parameters():
            p.fill_(float("nan"))
    return engine


def _parameter_of(engine: LoaderLlama) -> object:
    names = {p.untyped_storage().data_ptr(): n for n, p in engine.named_parameters()}
    return lambda dest: (names[dest.untyped_storage().data_ptr()], None)


def _dry_run(engine: LoaderLlama, plan: RankPlan) -> Destinations:
    return find_destinations(
        engine.load_weights,
        plan,
        device=CPU,
        parameter_of=_parameter_of(engine),  # type: ignore[arg-type]
    )


def _through_loaders(
    engine: LoaderLlama, path: Path, checkpoint: Checkpoint, plan: RankPlan
) -> set[str]:
    """``plan``'s shards read into buffers and copied in by the engine's loaders."""
    tensors, _ = load_rank(
        path, plan.rank, plan.tp_size, "scratch", "cpu", checkpoint=checkpoint, plan=plan
    )
    return engine.load_weights(
        (
            s.name,
            partial_tensor(
                s.name, s.full_shape, s.split, s.pieces, tensors[s.name], rank=plan.rank
            ),
        )
        for s in plan.shards
    )


def _reference(path: Path, tp: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    engine = _engine(path, tp, rank, dtype)
    checkpoint, plan = plan_rank(path, rank, tp)
    _through_loaders(engine, path, checkpoint, plan)
    return dict(engine.named_parameters())


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (4, 2), (8, 7)])
def test_every_tensor_goes_straight_into_its_region_of_a_parameter(
    tiny_llama: Path, tp: int, rank: int
) -> None:
    """Stacked q/k/v and gate/up, KV heads replicated at tp 8, split-1 o/down_proj, the
    vocabulary, norms: all plain regions, read in place, bytes equal to the loaders'."""
    engine = _engine(tiny_llama, tp, rank, torch.bfloat16)
    checkpoint, plan = plan_rank(tiny_llama, rank, tp)
    routes = _dry_run(engine, plan)
    assert routes.through_loaders == {} and routes.unused == ()
    assert set(routes.direct) == {s.name for s in plan.shards}
    storages = {p.untyped_storage().data_ptr() for p in engine.parameters()}
    for shard in plan.shards:
        region = routes.direct[shard.name]
        assert tuple(region.shape) == shard.shape and region.is_contiguous()
        assert region.untyped_storage().data_ptr() in storages  # the parameter's memory
    tensors, report = load_rank(
        tiny_llama, rank, tp, checkpoint=checkpoint, plan=plan, into=routes.direct
    )
    assert all(tensors[n] is routes.direct[n] for n in routes.direct)
    assert not any(p.attributes.get("copied_into_resident") for p in report.phases)
    assert report.bytes_read >= plan.nbytes
    reference = _reference(tiny_llama, tp, rank, torch.bfloat16)
    for name, param in engine.named_parameters():
        if name == "wide":
            continue
        assert _equal(param, reference[name]), name
        assert not torch.isnan(param).any(), f"{name}: not filled"


def test_the_dry_run_reads_nothing_and_the_loaders_see_the_full_shapes(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, 2, 0, torch.bfloat16)
    _, plan = plan_rank(tiny_llama, 0, 2)
    seen: dict[str, tuple[int, ...]] = {}

    def load_weights(weights: object) -> set[str]:
        listed = list(weights)  # type: ignore[call-overload]
        seen.update({name: tuple(w.shape) for name, w in listed})
        return engine.load_weights(listed)

    routes = find_destinations(
        load_weights,
        plan,
        device=CPU,
        parameter_of=_parameter_of(engine),  # type: ignore[arg-type]
    )
    assert seen == {s.name: s.full_shape for s in plan.shards}
    assert routes.loaded == {n for n, _ in engine.named_parameters() if n != "wide"}
    assert all(torch.isnan(p).all() for n, p in engine.named_parameters() if n != "wide")


def test_a_dtype_conversion_goes_through_the_weight_loader(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, 2, 1, torch.float32)  # the checkpoint is bfloat16
    _, plan = plan_rank(tiny_llama, 1, 2)
    routes = _dry_run(engine, plan)
    assert routes.direct == {} and set(routes.through_loaders) == {s.name for s in plan.shards}
    q = routes.through_loaders["model.layers.0.self_attn.q_proj.weight"]
    assert (q.reason, q.parameter) == ("dtype", "model.layers.0.self_attn.qkv_proj.weight")
    assert "checkpoint bfloat16, parameter float32" in q.detail
    assert routes.loader_bytes(plan) == {"dtype": plan.nbytes}
    direct, loaders = routes.split(plan)
    assert direct.shards == () and loaders.shards == plan.shards


def test_a_loader_that_computes_and_a_strided_region_fall_back_and_still_fill(
    tiny_llama: Path,
) -> None:
    """``w * 1`` (the dry run gives the loader zeros to go on with) and a strided region
    go through the loader with their bytes; everything else is read in place."""
    norm, first = "model.norm.weight", "model.layers.0.input_layernorm.weight"
    engine = _engine(tiny_llama, 2, 1, torch.bfloat16, convert={norm}, strided={first})
    checkpoint, plan = plan_rank(tiny_llama, 1, 2)
    routes = _dry_run(engine, plan)
    computes, strided = routes.through_loaders[norm], routes.through_loaders[first]
    assert (computes.reason, computes.parameter) == ("transform", norm)
    assert "mul" in computes.detail
    assert (strided.reason, strided.parameter) == ("layout", "wide")
    assert set(routes.through_loaders) == {norm, first}
    assert torch.count_nonzero(engine.model.norm.weight) == 0  # the dry run's zeros
    direct, loaders = routes.split(plan)
    load_rank(tiny_llama, 1, 2, checkpoint=checkpoint, plan=direct, into=routes.direct)
    _through_loaders(engine, tiny_llama, checkpoint, loaders)
    reference = _reference(tiny_llama, 2, 1, torch.bfloat16)
    for name, param in engine.named_parameters():
        if name not in ("wide", first):  # this engine puts ``first`` into ``wide``
            assert _equal(param, reference[name]), name
    shard, _ = load_rank(tiny_llama, 1, 2, checkpoint=checkpoint, plan=loaders)
    assert _equal(engine.wide[:, :128], shard[first].reshape(2, -1))


def test_strict_refuses_a_fallback_naming_the_tensor_the_parameter_and_why(
    tiny_llama: Path,
) -> None:
    engine = _engine(tiny_llama, 2, 0, torch.float32)
    _, plan = plan_rank(tiny_llama, 0, 2)
    routes = _dry_run(engine, plan)
    with pytest.raises(MethodUnavailableError) as info:
        routes.refuse_fallbacks(0)
    message = str(info.value)
    assert "rank 0" in message and "'model.embed_tokens.weight'" in message
    assert "parameter 'model.embed_tokens.weight'" in message
    assert "dtype conversion" in message and f"{len(plan.shards) - 1} more" in message
    Destinations().refuse_fallbacks(0)  # nothing falls back: nothing to refuse


def test_a_tensor_no_loader_takes_is_not_read(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, 2, 0, torch.bfloat16)
    _, plan = plan_rank(tiny_llama, 0, 2)
    skipped = "lm_head.weight"

    def load_weights(weights: object) -> set[str]:
        return engine.load_weights((n, w) for n, w in weights if n != skipped)  # type: ignore[attr-defined]

    routes = find_destinations(
        load_weights,
        plan,
        device=CPU,
        parameter_of=_parameter_of(engine),  # type: ignore[arg-type]
    )
    assert routes.unused == (skipped,)
    direct, loaders = routes.split(plan)
    assert skipped not in {s.name for s in direct.shards + loaders.shards}


def test_a_range_the_rank_did_not_plan_is_refused_before_anything_is_read(
    tiny_llama: Path,
) -> None:
    engine = _engine(tiny_llama, 2, 1, torch.bfloat16)  # rank 1's loaders ...
    _, plan = plan_rank(tiny_llama, 0, 2)  # ... given rank 0's shards
    with pytest.raises(ShardingError, match="does not give this rank") as info:
        _dry_run(engine, plan)
    assert info.value.tensor == plan.shards[0].name
    assert all(torch.isnan(p).all() for n, p in engine.named_parameters() if n != "wide")


def test_a_tensor_that_does_not_fit_its_parameter_is_one_error_before_any_read(
    tiny_llama: Path,
) -> None:
    """A loader copying a (256,) norm into a (300,) parameter, and one whose own check
    fails (vLLM asserts the shapes before it copies): each names the tensor, the
    parameter and both shapes."""
    _, plan = plan_rank(tiny_llama, 0, 1)
    norm = RankPlan(0, 1, tuple(s for s in plan.shards if s.name == "model.norm.weight"))
    param = torch.nn.Parameter(torch.zeros(300), requires_grad=False)

    def copies(weights: object) -> None:
        for _, w in weights:  # type: ignore[attr-defined]
            param.data.copy_(w)

    def asserts(weights: object) -> None:
        for _, w in weights:  # type: ignore[attr-defined]
            assert param.shape == w.shape
            param.data.copy_(w)

    for load_weights in (copies, asserts):
        with pytest.raises(CheckpointError) as info:
            find_destinations(
                load_weights, norm, device=CPU, parameter_of=lambda d: ("model.norm", None)
            )
        message = str(info.value)
        assert info.value.tensor == "model.norm.weight"
        assert "'model.norm.weight' [256]" in message and "'model.norm' [300]" in message
        assert "nothing was read" in message
    assert torch.count_nonzero(param) == 0


class Keeping:
    """An engine's ``load_weights`` that keeps every tensor it was given."""

    def __init__(self, engine: LoaderLlama) -> None:
        self.engine = engine
        self.kept: list[torch.Tensor] = []

    def __call__(self, weights: object) -> set[str]:
        items = list(weights)  # type: ignore[call-overload]
        self.kept.extend(tensor for _, tensor in items)
        return self.engine.load_weights(iter(items))


def test_a_stand_in_the_engine_keeps_does_not_keep_its_model_alive(tiny_llama: Path) -> None:
    """An engine may keep what its loaders were given (vLLM 0.32 keeps a stand-in after
    the dry run): the run's record of each copy, views of the parameters, must not then
    hold the model's memory once the model is gone."""
    import gc
    import warnings

    engine = _engine(tiny_llama, 2, 0, torch.bfloat16)
    keeping = Keeping(engine)
    _, plan = plan_rank(tiny_llama, 0, 2)
    destinations = find_destinations(
        keeping,
        plan,
        device=CPU,
        parameter_of=_parameter_of(engine),  # type: ignore[arg-type]
    )
    assert destinations.direct and keeping.kept
    kept = keeping.kept
    memory = {p.untyped_storage().data_ptr() for p in engine.parameters()}
    del engine, destinations, keeping
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gc.get_objects holds deprecated torch objects
        alive = [
            t
            for t in gc.get_objects()
            if isinstance(t, torch.Tensor)
            and not t.is_meta
            and t.untyped_storage().data_ptr() in memory
        ]
    assert kept and not alive, f"{len(alive)} views of the parameters outlived their model"
