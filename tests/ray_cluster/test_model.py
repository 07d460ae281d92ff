"""``rayload.load(model=factory)`` and engine phases on the session's real Ray: each rank's
module is filled in place from its own shards (zero copy on meta), a module that does not
fit is an input error naming the rank and parameter, and ``state.phase(...)`` in
``apply`` reaches the load's trace (same trace id, clock-corrected) through
``LoadResult.write_trace()``."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import rayload
import support.toy_llama
from rayload.actors.messages import RankState
from rayload.errors import InputError, ModelMismatchError
from rayload.loading.model import ModelContext
from support.toy_llama import ToyLlama, toy_llama_on_device, toy_llama_on_meta

pytestmark = pytest.mark.usefixtures("ray_cluster")

# Ray's workers cannot import tests/: send these modules' functions and classes by value.
ray.cloudpickle.register_pickle_by_value(support.toy_llama)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SKEW_NS = 5_000_000_000


def model_view(state: RankState) -> dict[str, Any]:
    """The rank's filled parameters (CPU copies) and whether each shares its tensor's
    storage (the zero-copy check must run in the rank, where the storage is)."""
    params = dict(state.model.named_parameters())
    return {
        "class": type(state.model).__name__,
        "params": {name: p.detach().clone() for name, p in params.items()},
        "same_storage": {
            name: params[name].untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
            for name, tensor in state.tensors.items()
            if name in params
        },
        "qkv_views": all(
            state.tensors[f"model.layers.{i}.self_attn.{p}_proj.weight"]
            .untyped_storage()
            .data_ptr()
            == params[f"model.layers.{i}.self_attn.qkv_proj.weight"].untyped_storage().data_ptr()
            for i in range(len(state.model.model.layers))
            for p in "qkv"
        ),
    }


@pytest.mark.parametrize("factory", [toy_llama_on_meta, toy_llama_on_device])
def test_model_factory_module_holds_each_ranks_shards(
    factory: Callable[[ModelContext], ToyLlama], tiny_llama: Path, no_leaks: object
) -> None:
    with rayload.load(tiny_llama, 2, device="cpu", model=factory) as result:
        views = result.apply(model_view)
        for rank, view in enumerate(views):
            assert view["class"] == "ToyLlama"
            params = view["params"]
            assert all(view["same_storage"].values()), "tensors point at the parameters"
            assert view["qkv_views"], "the q/k/v pieces are views of qkv_proj"
            for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
                assert torch.equal(params[name], result.shard(rank, name)), (rank, name)
            for layer in range(2):
                p = f"model.layers.{layer}."
                qkv = torch.cat(
                    [result.shard(rank, f"{p}self_attn.{x}_proj.weight") for x in "qkv"]
                )
                assert torch.equal(params[p + "self_attn.qkv_proj.weight"], qkv), (rank, layer)
                gate_up = torch.cat(
                    [result.shard(rank, f"{p}mlp.{x}_proj.weight") for x in ("gate", "up")]
                )
                assert torch.equal(params[p + "mlp.gate_up_proj.weight"], gate_up)
                o_proj = result.shard(rank, p + "self_attn.o_proj.weight")
                assert torch.equal(params[p + "self_attn.o_proj.weight"], o_proj)
        # Ranks hold different halves of a split tensor: the fill used each rank's own.
        assert not torch.equal(
            views[0]["params"]["lm_head.weight"], views[1]["params"]["lm_head.weight"]
        )


def test_model_that_does_not_fit_is_an_input_error_naming_rank_and_parameter(
    tiny_llama: Path, no_leaks: object
) -> None:
    def wrong_on_rank_1(context: ModelContext) -> ToyLlama:
        module = toy_llama_on_meta(context)
        if context.rank == 1:
            with torch.device("meta"):
                module.lm_head.weight = torch.nn.Parameter(
                    torch.empty(7, 256, dtype=torch.bfloat16)
                )
        return module

    with pytest.raises(ModelMismatchError) as info:
        rayload.load(tiny_llama, 2, device="cpu", model=wrong_on_rank_1, timeout=120)
    error = info.value
    assert isinstance(error, InputError) and error.exit_code == 2
    assert error.rank == 1 and error.parameter == "lm_head.weight"
    message = str(error)
    assert message.startswith("rank 1 on node ")
    assert "parameter 'lm_head.weight' has shape (7, 256)" in message
    assert "shard 'lm_head.weight' has shape (256, 256)" in message


def warmup(state: RankState, steps: int) -> int:
    with state.phase("warmup", steps=steps) as attrs:
        total = 0
        for _ in range(steps):
            total += int(state.model.lm_head.weight.float().sum().abs() > 0)
        attrs["done"] = total
    return total


def test_engine_phases_join_the_load_trace_per_rank_on_the_same_trace_id(
    tiny_llama: Path,
    tmp_path: Path,
    set_test_hooks: Callable[..., None],
    trace_reader: Callable[[Path], list[Any]],
    no_leaks: object,
) -> None:
    set_test_hooks(clock_skew_ns={"1": SKEW_NS})
    trace_dir = tmp_path / "trace"
    with rayload.load(
        tiny_llama, 2, device="cpu", model=toy_llama_on_meta, trace_dir=trace_dir
    ) as result:
        before = trace_reader(trace_dir)
        assert not [s for s in before if s.name == "engine.warmup"]
        apply_start = time.time_ns()
        assert result.apply(warmup, 3) == [3, 3]
        apply_end = time.time_ns()
        files = result.write_trace()
    assert files == result.trace_files and Path(files["otlp"]).parent == trace_dir
    spans = trace_reader(trace_dir)
    (root,) = [s for s in spans if s.name == "rayload.load"]
    (old_root,) = [s for s in before if s.name == "rayload.load"]
    assert (root.start_ns, root.end_ns) == (old_root.start_ns, old_root.end_ns)
    warmups = {s.rank: s for s in spans if s.name == "engine.warmup"}
    assert set(warmups) == {0, 1}
    for span in warmups.values():
        assert span.attributes["rayload.steps"] == 3 and span.attributes["rayload.done"] == 3
        assert span.attributes["rayload.tp_size"] == 2
        assert span.attributes["rayload.device"] == "cpu"
        # Rank 1's clock runs 5 s ahead: corrected onto the driver's, within the apply call.
        assert apply_start - 50_000_000 <= span.start_ns <= span.end_ns <= apply_end + 50_000_000
        assert root.end_ns <= span.start_ns
    assert abs(warmups[1].attributes["rayload.clock_offset_ms"] - SKEW_NS / 1e6) < 1000
    # The factory's own phase and the model phases sit inside each rank's load.
    loads = {s.rank: s for s in spans if s.name == "rank.load"}
    for name in ("engine.build_skeleton", "rank.model.build", "rank.model.fill"):
        inside = {s.rank: s for s in spans if s.name == name}
        assert set(inside) == {0, 1}, name
        for rank, span in inside.items():
            assert loads[rank].start_ns <= span.start_ns <= span.end_ns <= loads[rank].end_ns
    data = json.loads(Path(files["otlp"]).read_text())
    trace_ids = {
        span["traceId"]
        for resource in data["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    }
    assert trace_ids == {result.trace_id}
    assert "engine.warmup" in Path(files["html"]).read_text()


def test_engine_phases_of_an_apply_that_raised_reach_the_trace(
    tiny_llama: Path, tmp_path: Path, trace_reader: Callable[[Path], list[Any]], no_leaks: object
) -> None:
    def failing(state: RankState) -> None:
        with state.phase("compile"):
            if state.rank == 0:
                raise ValueError("no kernel")

    with rayload.load(tiny_llama, 2, device="cpu", process_group=None) as result:
        with pytest.raises(ValueError, match="no kernel"):
            result.apply(failing)
        files = result.write_trace(tmp_path)
        assert result.trace_files == {}, "the load wrote none: no trace_dir"
    assert set(files) == {"otlp", "jaeger", "chrome", "html"}
    compiles = {s.rank: s for s in trace_reader(tmp_path) if s.name == "engine.compile"}
    assert set(compiles) == {0, 1}, "rank 1's phase came back, rank 0's was fetched"
    assert compiles[0].error and not compiles[1].error


def test_a_load_from_a_peer_receives_straight_into_the_modules_parameters(
    tiny_llama: Path, no_leaks: object, tmp_path: Path, trace_reader: Any
) -> None:
    from rayload.loading.methods import LoadMethod

    with (
        rayload.load(tiny_llama, 2, device="cpu") as first,
        rayload.load(
            tiny_llama, 2, device="cpu", model=toy_llama_on_device, trace_dir=tmp_path
        ) as second,
    ):
        assert [r.method.effective for r in second.ranks] == [LoadMethod.PEER] * 2
        assert [r.bytes_from_storage for r in second.ranks] == [0, 0]
        for rank, view in enumerate(second.apply(model_view)):
            params = view["params"]
            assert all(view["same_storage"].values()) and view["qkv_views"], rank
            for layer in range(2):
                p = f"model.layers.{layer}."
                qkv = torch.cat([first.shard(rank, f"{p}self_attn.{x}_proj.weight") for x in "qkv"])
                assert torch.equal(params[p + "self_attn.qkv_proj.weight"], qkv), (rank, layer)
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                assert torch.equal(params[name], first.shard(rank, name)), (rank, name)
    fills = [s for s in trace_reader(tmp_path) if s.name == "rank.model.fill"]
    assert len(fills) == 2
    for fill, plan in zip(
        sorted(fills, key=lambda s: s.attributes["rayload.rank"]), second.plan.ranks, strict=True
    ):
        assert fill.attributes["rayload.model.copied_bytes"] == 0, "nothing copied after"
        assert fill.attributes["rayload.model.direct_bytes"] == plan.nbytes
