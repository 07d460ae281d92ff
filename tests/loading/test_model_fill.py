"""``fill_model`` and the model step (``build_module``, ``model_destinations``,
``fill_module``): the engine's module filled in place from a rank's shards, without Ray:
zero copy on meta, stacked parameters packed in the mapping's order with the pieces turned
into views, shards read straight into a module's own memory, and one clear error per
disagreement (before any byte is read when the module is built first)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from rayload.errors import ConfigError, InputError, ModelMismatchError
from rayload.loading import PhaseTimer, load_rank, plan_shards
from rayload.loading.fill import fill_model
from rayload.loading.model import (
    ModelContext,
    build_module,
    engine_phase_name,
    engine_phases,
    fill_module,
    model_destinations,
)
from support.toy_llama import (
    STACKED_PARAMS_MAPPING,
    ToyLlama,
    toy_llama_on_device,
    toy_llama_on_meta,
)

Reference = Callable[[Path, int, int, str, int | None], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, q: int, kv: int, hidden: int) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(hidden, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, hidden, bias=False)


class Mlp(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)


class Block(nn.Module):
    """qkv_proj (q 4 + k 2 + v 2 rows), o_proj, gate_up_proj (2 x 3 rows), a norm buffer."""

    stacked_params_mapping = STACKED_PARAMS_MAPPING

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention(q=4, kv=2, hidden=5)
        self.mlp = Mlp(hidden=5, inter=3)
        self.register_buffer("scale", torch.ones(5))


def block_shards(seed: int = 0) -> dict[str, torch.Tensor]:
    """A rank's shards for :class:`Block`, the pieces in another order than the mapping's."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "self_attn.v_proj.weight": torch.randn(2, 5, generator=gen),
        "mlp.up_proj.weight": torch.randn(3, 5, generator=gen),
        "self_attn.q_proj.weight": torch.randn(4, 5, generator=gen),
        "self_attn.o_proj.weight": torch.randn(5, 4, generator=gen),
        "self_attn.k_proj.weight": torch.randn(2, 5, generator=gen),
        "mlp.gate_proj.weight": torch.randn(3, 5, generator=gen),
        "scale": torch.randn(5, generator=gen),
    }


def meta_block() -> Block:
    with torch.device("meta"):
        return Block()


def test_fill_model_meta_parameter_takes_the_shards_storage_without_copy() -> None:
    module = meta_block()
    tensors = block_shards()
    o_proj, scale = tensors["self_attn.o_proj.weight"], tensors["scale"]
    fill = fill_model(module, tensors, rank=0)
    param = module.self_attn.o_proj.weight
    assert isinstance(param, nn.Parameter) and not param.requires_grad
    assert param.data_ptr() == o_proj.data_ptr(), "zero copy: the shard's own storage"
    assert module.scale.data_ptr() == scale.data_ptr()
    assert tensors["self_attn.o_proj.weight"].data_ptr() == o_proj.data_ptr()
    assert not any(p.is_meta for p in module.parameters())
    assert (fill.parameters, fill.buffers, fill.stacked, fill.zero_copy) == (3, 1, 2, 2)
    assert fill.copied_bytes == (8 + 6) * 5 * 4  # the stacked pieces, fp32


def test_fill_model_stacks_qkv_and_gate_up_in_mapping_order_and_leaves_views() -> None:
    module = meta_block()
    tensors = block_shards()
    q, k, v = (tensors[f"self_attn.{p}_proj.weight"].clone() for p in "qkv")
    gate, up = tensors["mlp.gate_proj.weight"].clone(), tensors["mlp.up_proj.weight"].clone()
    fill_model(module, tensors, rank=0)
    qkv = module.self_attn.qkv_proj.weight
    assert torch.equal(qkv, torch.cat([q, k, v]))
    assert torch.equal(module.mlp.gate_up_proj.weight, torch.cat([gate, up]))
    row = qkv.stride(0) * qkv.element_size()
    for name, offset in [("q", 0), ("k", 4), ("v", 6)]:
        piece = tensors[f"self_attn.{name}_proj.weight"]
        assert piece.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr(), name
        assert piece.data_ptr() == qkv.data_ptr() + offset * row, name
    assert torch.equal(tensors["self_attn.k_proj.weight"], k)
    up_view = tensors["mlp.up_proj.weight"]
    up_view.fill_(7.0)  # a view: writes land in the stacked parameter
    assert torch.equal(module.mlp.gate_up_proj.weight[3:], torch.full((3, 5), 7.0))


def test_fill_model_real_module_copies_in_and_points_the_tensors_at_parameters() -> None:
    module = Block()
    qkv_ptr = module.self_attn.qkv_proj.weight.data_ptr()
    tensors = block_shards()
    want = {name: t.clone() for name, t in tensors.items()}
    fill = fill_model(module, tensors, rank=0)
    assert fill.zero_copy == 0 and fill.copied_bytes > 0
    assert module.self_attn.qkv_proj.weight.data_ptr() == qkv_ptr, "the module's own storage"
    assert torch.equal(module.self_attn.o_proj.weight, want["self_attn.o_proj.weight"])
    for name in want:
        assert torch.equal(tensors[name], want[name]), name
    o_proj = tensors["self_attn.o_proj.weight"]
    assert o_proj.data_ptr() == module.self_attn.o_proj.weight.data_ptr()
    assert tensors["scale"].data_ptr() == module.scale.data_ptr()


def test_fill_model_fills_tied_parameters_once_in_every_owner() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.embed.weight

    with torch.device("meta"):
        module = Tied()
    shard = torch.randn(6, 4)
    fill = fill_model(module, {"embed.weight": shard}, rank=0)
    assert fill.parameters == 1
    assert module.head.weight is module.embed.weight
    assert module.head.weight.data_ptr() == shard.data_ptr()


def load_toy_llama(
    path: Path, factory: Callable[[ModelContext], nn.Module], method: str = "scratch"
) -> tuple[nn.Module, dict[str, torch.Tensor], list[str], dict[str, object]]:
    """Rank 1 of 2 of ``path`` loaded as the rank actor loads a ``model=`` factory's
    module: built first, read into its memory where it has it, filled after the read.
    Returns the module, the rank's tensors, the phase names and rank.model.fill's
    attributes."""
    timer = PhaseTimer()
    context = ModelContext(
        rank=1, tp_size=2, device="cpu", config=plan_config(path), phase=engine_phases(timer)
    )
    module = build_module(factory, context, timer=timer)
    tensors, report = load_rank(
        path,
        1,
        2,
        method,
        "cpu",
        timer=timer,
        into=model_destinations(module, method, "cpu"),
        post_load=lambda tensors: fill_module(module, tensors, rank=1, timer=timer),
    )
    names = [p.name for p in report.phases]
    (fill,) = [p for p in report.phases if p.name == "rank.model.fill"]
    return module, tensors, names, dict(fill.attributes)


def assert_holds_rank_1(module: nn.Module, path: Path, reference_shard: Reference) -> None:
    """Every parameter of ``module`` is rank 1's shard of ``path`` (qkv stacked)."""
    plan = plan_shards(path, 2)
    params = dict(module.named_parameters())
    for name, split in plan.splits.items():
        if name in params:
            assert torch.equal(params[name], reference_shard(path, 1, 2, name, split)), name
    layer = module.model.layers[0]
    q, k, v = (
        reference_shard(path, 1, 2, f"model.layers.0.self_attn.{p}_proj.weight", 0) for p in "qkv"
    )
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]))


def test_model_on_meta_takes_the_shards_storage_and_its_stacked_parameters_are_read_into(
    tiny_llama: Path, reference_shard: Reference
) -> None:
    module, tensors, names, fill = load_toy_llama(tiny_llama, toy_llama_on_meta)
    assert isinstance(module, ToyLlama)
    params = dict(module.named_parameters())
    assert params["model.embed_tokens.weight"].data_ptr() == (
        tensors["model.embed_tokens.weight"].data_ptr()
    )
    assert_holds_rank_1(module, tiny_llama, reference_shard)
    qkv = module.model.layers[0].self_attn.qkv_proj.weight
    assert tensors["model.layers.0.self_attn.k_proj.weight"].data_ptr() > qkv.data_ptr()
    # The module is built before the checkpoint is opened, filled after the read.
    assert names.index("rank.model.build") < names.index("rank.resolve")
    assert names.index("rank.plan") < names.index("rank.destinations") < names.index("rank.read")
    assert {"engine.build_skeleton", "rank.model.fill"} <= set(names)
    assert fill["model.stacked"] == 2 * 2  # qkv + gate_up per layer
    assert fill["model.copied_bytes"] == 0, "the pieces were read into their rows"
    stacked = sum(
        t.numel() * t.element_size()
        for n, t in tensors.items()
        if any(f".{p}_proj." in n for p in ("q", "k", "v", "gate", "up"))
    )
    assert fill["model.direct_bytes"] == stacked > 0


def test_model_with_real_parameters_is_read_into_them_without_a_copy(
    tiny_llama: Path, reference_shard: Reference
) -> None:
    built: dict[str, int] = {}

    def factory(context: ModelContext) -> nn.Module:
        module = toy_llama_on_device(context)
        built.update((n, p.data_ptr()) for n, p in module.named_parameters())
        return module

    module, tensors, _, fill = load_toy_llama(tiny_llama, factory)
    assert {n: p.data_ptr() for n, p in module.named_parameters()} == built, "same memory"
    assert_holds_rank_1(module, tiny_llama, reference_shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert fill["model.direct_bytes"] == total and fill["model.copied_bytes"] == 0
    assert fill["model.zero_copy"] == 0
    params = dict(module.named_parameters())
    assert tensors["lm_head.weight"].data_ptr() == params["lm_head.weight"].data_ptr()


def test_model_of_another_dtype_is_converted_by_a_copy_the_fill_counts(
    tiny_llama: Path, reference_shard: Reference
) -> None:
    def float32_llama(context: ModelContext) -> nn.Module:
        return ToyLlama(context.config, context.tp_size, torch.float32)

    module, tensors, _, fill = load_toy_llama(tiny_llama, float32_llama)
    total = sum(t.numel() * 2 for t in tensors.values())  # bf16 in the checkpoint
    assert fill["model.copied_bytes"] == total and fill["model.direct_bytes"] == 0
    params = dict(module.named_parameters())
    want = reference_shard(tiny_llama, 1, 2, "model.norm.weight", None)
    assert torch.equal(params["model.norm.weight"], want.float())


def test_model_that_does_not_fit_the_shards_fails_before_any_byte_is_read(
    tiny_llama: Path,
) -> None:
    def built_for_one_rank(context: ModelContext) -> nn.Module:
        return ToyLlama(context.config, 1, torch.bfloat16)

    timer = PhaseTimer()
    context = ModelContext(rank=1, tp_size=2, device="cpu", config=plan_config(tiny_llama))
    module = build_module(built_for_one_rank, context, timer=timer)
    with pytest.raises(ModelMismatchError, match=r"rank 1: .* has shape") as info:
        load_rank(
            tiny_llama,
            1,
            2,
            "scratch",
            "cpu",
            timer=timer,
            into=model_destinations(module, "scratch", "cpu"),
        )
    assert info.value.exit_code == 2
    names = [p.name for p in timer.records]
    assert "rank.destinations" in names and "rank.read" not in names


@pytest.mark.parametrize(
    ("method", "peer", "factory"),
    [
        ("fastsafetensors", False, toy_llama_on_device),
        ("dummy", False, toy_llama_on_device),
        ("auto", True, toy_llama_on_device),
        ("scratch", False, lambda context: Block()),
    ],
)
def test_model_destinations_only_where_the_reader_fills_the_modules_memory(
    tiny_llama: Path, method: str, peer: bool, factory: Callable[[ModelContext], nn.Module]
) -> None:
    context = ModelContext(rank=0, tp_size=2, device="cpu", config=plan_config(tiny_llama))
    module = factory(context)
    fills = method == "scratch" or (peer and method == "auto")  # a channel writes host memory
    assert (model_destinations(module, method, "cpu", peer=peer) is None) == (not fills)
    assert model_destinations(module, "auto", "cuda:0", peer=True) is None, "gloo lands on host"
    with torch.device("meta"):
        bare = nn.Linear(3, 3)  # all on meta, nothing stacked: takes the shards as read
    assert model_destinations(bare, "scratch", "cpu") is None


def plan_config(path: Path) -> dict[str, object]:
    from rayload.loading.checkpoint import open_checkpoint

    return dict(open_checkpoint(path).config or {})


def mismatch(module: nn.Module, tensors: dict[str, torch.Tensor]) -> ModelMismatchError:
    with pytest.raises(ModelMismatchError) as info:
        fill_model(module, tensors, rank=1)
    error = info.value
    assert isinstance(error, InputError) and error.exit_code == 2
    assert error.rank == 1 and str(error).startswith("rank 1: ")
    return error


def test_fill_model_parameter_without_tensor_is_one_error_naming_it_and_its_shape() -> None:
    tensors = block_shards()
    del tensors["self_attn.o_proj.weight"]
    module = meta_block()
    error = mismatch(module, tensors)
    assert error.parameter == "self_attn.o_proj.weight"
    assert "parameter 'self_attn.o_proj.weight' (5, 4) has no tensor" in str(error)
    assert module.self_attn.qkv_proj.weight.is_meta, "nothing is filled when it fails"


def test_fill_model_tensor_without_parameter_is_an_error_naming_the_tensor() -> None:
    tensors = {**block_shards(), "self_attn.rotary.inv_freq": torch.ones(3)}
    error = mismatch(meta_block(), tensors)
    assert error.tensor == "self_attn.rotary.inv_freq"
    assert "tensor 'self_attn.rotary.inv_freq' (3) of the rank's shards has no parameter" in str(
        error
    )


def test_fill_model_shape_mismatch_names_parameter_tensor_and_both_shapes() -> None:
    tensors = {**block_shards(), "self_attn.o_proj.weight": torch.ones(5, 8)}
    error = mismatch(meta_block(), tensors)
    assert error.parameter == "self_attn.o_proj.weight"
    assert "'self_attn.o_proj.weight' has shape (5, 4)" in str(error)
    assert "shard 'self_attn.o_proj.weight' has shape (5, 8)" in str(error)


def test_fill_model_stacked_total_mismatch_names_parameter_and_pieces() -> None:
    tensors = {**block_shards(), "self_attn.k_proj.weight": torch.ones(3, 5)}
    error = mismatch(meta_block(), tensors)
    assert error.parameter == "self_attn.qkv_proj.weight"
    message = str(error)
    assert "stacked parameter 'self_attn.qkv_proj.weight' has shape (8, 5)" in message
    assert "q (4, 5) + k (3, 5) + v (2, 5)" in message


def test_fill_model_stacked_missing_piece_says_which() -> None:
    tensors = block_shards()
    del tensors["self_attn.v_proj.weight"]
    error = mismatch(meta_block(), tensors)
    assert "'self_attn.qkv_proj.weight' (8, 5) is made of pieces q, k, v" in str(error)
    assert "(missing v)" in str(error)


def test_fill_model_unfilled_meta_buffer_is_an_error() -> None:
    tensors = block_shards()
    del tensors["scale"]
    error = mismatch(meta_block(), tensors)
    assert "buffer 'scale' (5) is on the meta device" in str(error)


def test_fill_model_unfilled_real_buffer_is_kept() -> None:
    tensors = block_shards()
    del tensors["scale"]
    module = Block()
    fill_model(module, tensors, rank=0)
    assert torch.equal(module.scale, torch.ones(5))


def test_fill_model_meta_dtype_mismatch_asks_for_the_checkpoint_dtype() -> None:
    tensors = {**block_shards(), "self_attn.o_proj.weight": torch.ones(5, 4, dtype=torch.half)}
    error = mismatch(meta_block(), tensors)
    assert "meta parameter 'self_attn.o_proj.weight' is float32" in str(error)
    assert "'self_attn.o_proj.weight' is float16" in str(error)


def test_fill_model_several_problems_are_one_error_listing_the_rest() -> None:
    tensors = block_shards()
    del tensors["self_attn.o_proj.weight"], tensors["mlp.gate_proj.weight"]
    error = mismatch(meta_block(), tensors)
    assert "(and 1 more: " in str(error) and "gate_up_proj" in str(error)


def test_build_model_factory_not_returning_a_module_is_a_config_error() -> None:
    context = ModelContext(rank=0, tp_size=1, device="cpu", config={})
    timer = PhaseTimer()
    with pytest.raises(ConfigError, match="rank 0: the model factory returned dict"):
        build_module(lambda _: {}, context, timer=timer)
    assert [p.name for p in timer.records] == ["rank.model.build"]
    assert all(p.error for p in timer.records)


def test_engine_phase_name_prefixes_once() -> None:
    assert engine_phase_name("warmup") == "engine.warmup"
    assert engine_phase_name("engine.warmup") == "engine.warmup"
    with pytest.raises(ConfigError):
        engine_phase_name("")
