"""``load_rank``: one rank in a plain process, through the public API.

The headline check: for tp 1, 2 and 4 every reading method yields, for every rank and
tensor, exactly the bytes the safetensors library's tensors sliced by hand hold, on a
multi-file checkpoint with split-0, split-1 and replicated tensors in BF16, F16, F32 and
I32.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rayload.errors import CheckpointError, ConfigError, MethodUnavailableError
from rayload.loading import (
    EnvProbe,
    LoadMethod,
    PhaseTimer,
    convert_checkpoint,
    load_rank,
    plan_shards,
)
from rayload.loading.report import PHASES
from rayload.loading.synthetic import write_checkpoint
from support.reading import bytes_to_read

Reference = Callable[[Path, int, int, str, int | None], torch.Tensor]
NO_FASTSAFETENSORS = EnvProbe(fastsafetensors_error="ImportError: not installed")


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def converted_dirs(
    mixed_dtype_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, Path]:
    """``rayload convert`` output of the mixed-dtype checkpoint for tp 1, 2 and 4."""
    root = tmp_path_factory.mktemp("converted")
    return {
        tp: convert_checkpoint(mixed_dtype_checkpoint, root / f"tp{tp}", tp) for tp in (1, 2, 4)
    }


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("method", ["scratch", "converted", "fastsafetensors"])
def test_every_method_matches_safetensors_reference_bit_for_bit(
    method: str,
    tp: int,
    mixed_dtype_checkpoint: Path,
    converted_dirs: dict[int, Path],
    reference_shard: Reference,
) -> None:
    path = converted_dirs[tp] if method == "converted" else mixed_dtype_checkpoint
    plan = plan_shards(mixed_dtype_checkpoint, tp)
    splits = {plan.split_dim(name) for name in plan.splits}
    assert splits == {0, 1, None}
    for rank in range(tp):
        tensors, report = load_rank(path, rank, tp, method, "cpu")
        assert report.method.effective is LoadMethod(method)
        assert report.method.fallback_reason is None
        assert set(tensors) == set(plan.splits)
        for name, got in tensors.items():
            want = reference_shard(mixed_dtype_checkpoint, rank, tp, name, plan.split_dim(name))
            assert got.dtype == want.dtype, name
            assert got.shape == want.shape, name
            assert torch.equal(raw(got), raw(want)), f"{method} tp={tp} rank={rank} {name}"


def test_dtypes_cover_bf16_f16_f32_and_int(mixed_dtype_checkpoint: Path) -> None:
    tensors, _ = load_rank(mixed_dtype_checkpoint, 0, 2)
    assert {t.dtype for t in tensors.values()} == {
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.int32,
    }


def test_scratch_matches_reference_on_generated_llama(
    tiny_llama: Path, reference_shard: Reference
) -> None:
    plan = plan_shards(tiny_llama, 2)
    tensors, report = load_rank(tiny_llama, 1, 2)
    assert report.bytes_read == bytes_to_read(plan.ranks[1].shards)
    for name, got in tensors.items():
        want = reference_shard(tiny_llama, 1, 2, name, plan.split_dim(name))
        assert torch.equal(raw(got), raw(want)), name


def test_dummy_matches_shapes_and_dtypes_and_reads_nothing(
    mixed_dtype_checkpoint: Path, reference_shard: Reference
) -> None:
    plan = plan_shards(mixed_dtype_checkpoint, 4)
    tensors, report = load_rank(mixed_dtype_checkpoint, 3, 4, "dummy")
    assert report.bytes_read == 0
    assert report.method.effective is LoadMethod.DUMMY
    for name, got in tensors.items():
        want = reference_shard(mixed_dtype_checkpoint, 3, 4, name, plan.split_dim(name))
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name


def test_report_describes_the_rank_load(mixed_dtype_checkpoint: Path) -> None:
    timer = PhaseTimer()
    tensors, report = load_rank(mixed_dtype_checkpoint, 1, 2, "scratch", "auto", timer=timer)
    plan = plan_shards(mixed_dtype_checkpoint, 2).ranks[1]
    local = "cuda:0" if torch.cuda.is_available() else "cpu"  # what "auto" means here
    assert (report.rank, report.tp_size, report.device, report.model_role) == (1, 2, local, "main")
    assert report.bytes_read == bytes_to_read(plan.shards)
    assert report.tensors == len(tensors) == len(plan.shards)
    assert report.files == plan.files
    assert [p.name for p in report.phases] == list(PHASES)
    assert report.phases == tuple(timer.records)
    assert report.start_ns <= report.phases[0].start_ns
    assert report.phases[-1].end_ns <= report.end_ns
    resolve = report.phases[0].attributes
    assert resolve["method.requested"] == resolve["method.selected"] == "scratch"
    assert "fallback_reason" not in resolve
    assert report.phases[1].attributes["bytes"] == plan.nbytes
    assert report.to_dict()["method"] == {
        "requested": "scratch",
        "selected": "scratch",
        "effective": "scratch",
        "fallback_reason": None,
    }


def test_auto_selects_converted_for_a_converted_checkpoint(converted_dirs: dict[int, Path]) -> None:
    _, report = load_rank(converted_dirs[2], 0, 2, "auto")
    assert (report.method.requested, report.method.selected) == (
        LoadMethod.AUTO,
        LoadMethod.CONVERTED,
    )


def test_fallback_is_reported_and_logged(
    mixed_dtype_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rayload"):
        _, report = load_rank(mixed_dtype_checkpoint, 0, 2, "converted")
    assert (report.method.selected, report.method.effective) == (
        LoadMethod.SCRATCH,
        LoadMethod.SCRATCH,
    )
    reason = report.method.fallback_reason
    assert reason is not None and "rayload convert" in reason
    assert report.phases[0].attributes["fallback_reason"] == reason
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "rank 0: load method converted falls back to scratch" in caplog.text


def test_injected_probe_without_fastsafetensors_falls_back_to_scratch(
    mixed_dtype_checkpoint: Path,
) -> None:
    _, report = load_rank(mixed_dtype_checkpoint, 0, 2, "fastsafetensors", probe=NO_FASTSAFETENSORS)
    assert report.method.effective is LoadMethod.SCRATCH
    assert report.method.fallback_reason is not None
    assert "fastsafetensors is not installed" in report.method.fallback_reason


def test_strict_turns_fallback_into_error(mixed_dtype_checkpoint: Path) -> None:
    timer = PhaseTimer()
    with pytest.raises(MethodUnavailableError, match=r"rayload-manifest\.json"):
        load_rank(mixed_dtype_checkpoint, 0, 2, "converted", strict=True, timer=timer)
    assert [(r.name, r.error is not None) for r in timer.records] == [("rank.resolve", True)]


def test_converted_checkpoint_for_other_tp_is_an_error(converted_dirs: dict[int, Path]) -> None:
    with pytest.raises(CheckpointError, match="converted for tp_size=2, not 4") as info:
        load_rank(converted_dirs[2], 0, 4, "converted")
    assert info.value.file == str(converted_dirs[2] / "rayload-manifest.json")


@pytest.mark.parametrize("method", ["scratch", "fastsafetensors", "converted", "auto"])
def test_flipped_data_byte_in_converted_file_raises_for_every_reading_method(
    mixed_dtype_checkpoint: Path, tmp_path: Path, method: str
) -> None:
    converted = convert_checkpoint(mixed_dtype_checkpoint, tmp_path / "tp2", 2)
    victim = converted / "model-rank-1-part-0.safetensors"
    with open(victim, "r+b") as f:  # the last byte is tensor data; size unchanged
        f.seek(-1, 2)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    load_rank(converted, 0, 2, method)  # rank 0's files are intact
    with pytest.raises(CheckpointError, match="CRC-32") as info:
        load_rank(converted, 1, 2, method)
    assert info.value.file == str(victim)


def test_fastsafetensors_on_converted_checkpoint_verifies_files_in_resolve(
    converted_dirs: dict[int, Path],
) -> None:
    _, report = load_rank(converted_dirs[2], 1, 2, "fastsafetensors")
    assert report.method.effective is LoadMethod.FASTSAFETENSORS
    assert report.method.fallback_reason is None
    resolve_phase = report.phases[0]
    assert resolve_phase.name == "rank.resolve"
    assert resolve_phase.attributes["checksums_verified"] == 1


@pytest.mark.parametrize(("rank", "tp"), [(2, 2), (-1, 2), (0, 0)])
def test_rank_out_of_range_is_config_error(
    mixed_dtype_checkpoint: Path, rank: int, tp: int
) -> None:
    with pytest.raises(ConfigError):
        load_rank(mixed_dtype_checkpoint, rank, tp)


def test_unknown_method_is_config_error(mixed_dtype_checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="valid values: auto, scratch"):
        load_rank(mixed_dtype_checkpoint, 0, 2, "mmap")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_config_error(mixed_dtype_checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        load_rank(mixed_dtype_checkpoint, 0, 2, device="cuda")


def test_post_load_runs_on_the_tensors_inside_its_phase(mixed_dtype_checkpoint: Path) -> None:
    seen: list[int] = []
    tensors, report = load_rank(
        mixed_dtype_checkpoint, 0, 2, post_load=lambda t: seen.append(len(t))
    )
    assert seen == [len(tensors)]
    assert report.phases[-1].name == "rank.post_load"


def test_failed_post_load_keeps_phases_in_callers_timer(mixed_dtype_checkpoint: Path) -> None:
    def broken(tensors: dict[str, torch.Tensor]) -> None:
        raise ValueError("bad weights")

    timer = PhaseTimer()
    with pytest.raises(ValueError, match="bad weights"):
        load_rank(mixed_dtype_checkpoint, 0, 2, timer=timer, post_load=broken)
    assert [r.name for r in timer.records] == list(PHASES)
    assert timer.records[-1].error is not None


def test_draft_role_is_recorded(mixed_dtype_checkpoint: Path) -> None:
    _, report = load_rank(mixed_dtype_checkpoint, 0, 1, model_role="draft")
    assert report.model_role == "draft"
    with pytest.raises(ConfigError, match="model_role"):
        load_rank(mixed_dtype_checkpoint, 0, 1, model_role="target")


_PEAK_SCRIPT = """
import json, sys
from rayload.loading import load_rank, plan_shards

def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

path, method = sys.argv[1], sys.argv[2]
plan = plan_shards(path, 4)
load_rank(path, 0, 4, "dummy")                 # warm imports and allocator paths
with open("/proc/self/clear_refs", "w") as f:   # reset VmHWM to the current RSS
    f.write("5")
before = hwm()
tensors, report = load_rank(path, 1, 4, method)
print(json.dumps({"growth": hwm() - before, "shard": plan.ranks[1].nbytes,
                  "total": plan.checkpoint_bytes, "read": report.bytes_read}))
"""


@pytest.fixture(scope="module")
def checkpoint_300mb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~300 MB of small Llama layers: ~130k split-1 rows per rank at tp 4."""
    return write_checkpoint(
        tmp_path_factory.mktemp("ckpt300") / "ckpt", preset="tiny-llama", size_gb=0.3, seed=3
    )


def test_scratch_peak_memory_is_near_the_shard_not_the_checkpoint(checkpoint_300mb: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(checkpoint_300mb), "scratch"],
        check=True,
        capture_output=True,
        text=True,
    )
    figures = json.loads(proc.stdout)
    assert figures["total"] > 250e6
    assert figures["read"] == bytes_to_read(plan_shards(checkpoint_300mb, 4).ranks[1].shards)
    assert figures["growth"] < figures["shard"] + 64 * 2**20, figures
    assert figures["growth"] < figures["total"] / 2, figures
