"""Backends on hand-built and planned RankPlans over real safetensors files.

Bit-identical results across every method, rank and tp live in test_rank.py (through
``load_rank``); here each backend's own contract: what it reads, what it reports, how it
fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rayload.errors import CheckpointError, ConfigError
from rayload.loading.backends import BACKENDS, Backend, register
from rayload.loading.backends.fastsafetensors import FastsafetensorsGdrBackend
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import ByteRange, RankPlan, RowRanges, TensorShard, plan_shards
from rayload.loading.probe import EnvProbe, probe_environment
from rayload.loading.reader import ReaderOptions, ReadSettings
from rayload.loading.reader.readplan import Segment, plan_reads, shard_segments
from rayload.loading.reader.reads import read_segments
from rayload.loading.report import PHASES, PhaseTimer
from support.reading import bytes_to_read

CPU = torch.device("cpu")
Reference = Callable[[Path, int, int, str, int | None], torch.Tensor]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def rchar() -> int:
    """Bytes this process has read through read-like syscalls so far (Linux)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.fixture(scope="module")
def probe() -> EnvProbe:
    return probe_environment()


@pytest.fixture
def matrix_file(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """One f32 8x6 matrix (values 0..47) in a file of its own, after a 1-element tensor."""
    matrix = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    path = tmp_path / "m.safetensors"
    save_file({"a_first": torch.ones(1, dtype=torch.float32), "matrix": matrix}, str(path))
    return path, matrix


def hand_plan(path: Path, rank: int, tp: int, split: int | None) -> RankPlan:
    """Rank ``rank``'s shard of ``matrix`` computed here, independently of plan_shards."""
    info = open_checkpoint(path).tensors["matrix"]
    rows, cols, item = 8, 6, 4
    pieces: tuple[tuple[int, int], ...] = ()
    if split is None:
        ranges, shape = [ByteRange(str(path), info.start, info.nbytes)], (rows, cols)
    elif split == 0:
        n = rows // tp
        ranges = [ByteRange(str(path), info.start + rank * n * cols * item, n * cols * item)]
        shape, pieces = (n, cols), ((rank * n, n),)
    else:
        n = cols // tp
        ranges = [
            ByteRange(str(path), info.start + (r * cols + rank * n) * item, n * item)
            for r in range(rows)
        ]
        shape, pieces = (rows, n), ((rank * n, n),)
    shard = TensorShard("matrix", "F32", (rows, cols), shape, split, tuple(ranges), pieces)
    return RankPlan(rank, tp, (shard,))


# --- registry -------------------------------------------------------------------------


def test_registry_has_one_distinct_class_per_concrete_method() -> None:
    concrete = set(LoadMethod) - {LoadMethod.AUTO}
    assert set(BACKENDS) == concrete
    assert len(set(BACKENDS.values())) == len(concrete)
    for method, cls in BACKENDS.items():
        assert cls.method is method
        assert issubclass(cls, Backend)


def test_register_refuses_a_second_backend_for_a_method() -> None:
    with pytest.raises(RuntimeError, match="already has backend ScratchBackend"):

        @register(LoadMethod.SCRATCH)
        class Again(BACKENDS[LoadMethod.SCRATCH]):  # type: ignore[misc, valid-type]
            pass


# --- scratch --------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "split"), [(2, 0), (2, 1), (3, 1), (1, None), (4, None)])
def test_scratch_reads_hand_built_plan_bit_identical(
    matrix_file: tuple[Path, torch.Tensor], probe: EnvProbe, tp: int, split: int | None
) -> None:
    path, matrix = matrix_file
    for rank in range(tp):
        result = BACKENDS[LoadMethod.SCRATCH](probe).load(
            hand_plan(path, rank, tp, split), CPU, PhaseTimer()
        )
        expected = matrix if split is None else torch.tensor_split(matrix, tp, split)[rank]
        assert torch.equal(raw(result.tensors["matrix"]), raw(expected))
        if split == 1:  # rows 24 bytes apart: read as one run, first row to last, and gathered
            assert result.bytes_read == 7 * 24 + expected.shape[1] * 4
        else:
            assert result.bytes_read == expected.numel() * 4


@pytest.mark.parametrize(
    ("cols", "tp", "gathered"),
    [(1024, 4, True), (6, 3, True), (2048, 2, False), (4096, 4, False)],
    ids=["1KiB-rows-3KiB-gaps", "8B-rows", "4KiB-gaps", "12KiB-gaps"],
)
def test_strided_rows_closer_than_a_page_are_gathered_wider_ones_read_row_by_row(
    tmp_path: Path, cols: int, tp: int, gathered: bool
) -> None:
    rows, n, rank = 600, cols // tp, tp - 1
    matrix = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    path = tmp_path / "m.bin"
    matrix.numpy().tofile(path)
    shard, span = rows * n * 4, (rows - 1) * cols * 4 + n * 4
    seg = Segment(str(path), rank * n * 4, shard, 0, 0, "m", row=n * 4, stride=cols * 4)
    options = ReaderOptions(threads=2)  # one read: 600 rows, several bounce buffers' worth
    read_segments([seg], [shard], CPU, options)  # warm up
    before = rchar()
    [buffer], sink, nbytes = read_segments([seg], [shard], CPU, options)
    read = rchar() - before
    sink.finish()
    assert torch.equal(buffer.view(torch.int32).reshape(rows, n), matrix[:, rank * n :])
    if gathered:  # the gaps are read too, never more than the span of the rows
        assert shard < nbytes <= span
    else:
        assert nbytes == shard
    assert nbytes <= read < nbytes + 16 * 1024  # what it reports is what it read


def test_scratch_small_chunks_split_large_tensors_and_stay_exact(
    mixed_dtype_checkpoint: Path, reference_shard: Reference, probe: EnvProbe
) -> None:
    plan = plan_shards(mixed_dtype_checkpoint, 2).ranks[1]
    options = ReaderOptions(threads=3, chunk_bytes=4096, staging_buffers=2)
    result = BACKENDS[LoadMethod.SCRATCH](probe, options=options).load(plan, CPU, PhaseTimer())
    for shard in plan.shards:
        want = reference_shard(mixed_dtype_checkpoint, 1, 2, shard.name, shard.split)
        assert torch.equal(raw(result.tensors[shard.name]), raw(want)), shard.name
    assert max(r.length for r in plan_reads(shard_segments(plan.shards), 4096)) <= 4096


def test_reader_threads_and_chunks_are_decided_per_destination() -> None:
    host = ReaderOptions().for_device(torch.device("cpu"))
    assert (host.threads, host.chunk_bytes, host.window) == (4, 32 << 20, 6)
    cpus = len(os.sched_getaffinity(0))
    gpu = ReaderOptions().for_device(torch.device("cuda", 0))  # no CUDA needed to decide
    assert (gpu.threads, gpu.chunk_bytes) == (min(12, max(4, cpus)), 8 << 20)
    assert gpu.window == gpu.threads + 2
    fixed = ReaderOptions(threads=3, chunk_bytes=1 << 20, staging_buffers=2)
    assert fixed.for_device(torch.device("cuda", 0)) == ReadSettings(3, 1 << 20, 2)


def test_scratch_reads_no_more_bytes_than_the_plan(
    mixed_dtype_checkpoint: Path, probe: EnvProbe
) -> None:
    plan = plan_shards(mixed_dtype_checkpoint, 4).ranks[2]
    backend = BACKENDS[LoadMethod.SCRATCH](probe)
    backend.load(plan, CPU, PhaseTimer())  # warm up: imports, thread pool code paths
    before = rchar()
    result = backend.load(plan, CPU, PhaseTimer())
    read = rchar() - before
    assert result.bytes_read == bytes_to_read(plan.shards)
    assert result.bytes_read <= read < result.bytes_read + 16 * 1024
    file_bytes = sum(os.path.getsize(f) for f in plan.files)
    assert plan.nbytes < file_bytes / 2  # the check above would catch a whole-file read


# A file that changed after it was planned: rayload's reader finds it out by reading;
# fastsafetensors raises its own errors (a bare Exception for a short file), which its
# backend turns into the same CheckpointError.
FILE_READERS = [LoadMethod.SCRATCH, LoadMethod.FASTSAFETENSORS]


@pytest.mark.parametrize("method", FILE_READERS)
def test_backend_raises_naming_file_and_tensor_when_file_is_truncated(
    matrix_file: tuple[Path, torch.Tensor], probe: EnvProbe, method: LoadMethod
) -> None:
    path, _ = matrix_file
    plan = hand_plan(path, 1, 2, 0)
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(CheckpointError, match="truncated") as info:
        BACKENDS[method](probe).load(plan, CPU, PhaseTimer())
    assert (info.value.file, info.value.tensor) == (str(path), "matrix")
    assert str(path) in str(info.value)


@pytest.mark.parametrize("method", FILE_READERS)
def test_backend_raises_naming_file_when_it_is_missing(
    matrix_file: tuple[Path, torch.Tensor], probe: EnvProbe, method: LoadMethod
) -> None:
    path, _ = matrix_file
    plan = hand_plan(path, 0, 2, 1)
    path.unlink()
    with pytest.raises(CheckpointError, match="cannot open") as info:
        BACKENDS[method](probe).load(plan, CPU, PhaseTimer())
    assert info.value.file == str(path)


def test_timer_keeps_the_failed_read_phase(
    matrix_file: tuple[Path, torch.Tensor], probe: EnvProbe
) -> None:
    path, _ = matrix_file
    plan = hand_plan(path, 1, 2, 0)
    os.truncate(path, 100)
    timer = PhaseTimer()
    with pytest.raises(CheckpointError):
        BACKENDS[LoadMethod.SCRATCH](probe).load(plan, CPU, timer)
    [record] = timer.records
    assert record.name == "rank.read"
    assert record.error is not None and "truncated" in record.error


# peer needs a source to copy from: tests/loading/test_peer.py checks its phases.
@pytest.mark.parametrize("method", sorted(set(LoadMethod) - {LoadMethod.AUTO, LoadMethod.PEER}))
def test_backends_record_read_to_device_sync_phases(
    method: LoadMethod,
    mixed_dtype_checkpoint: Path,
    make_converted: Callable[[Path, Path, int], Path],
    tmp_path: Path,
    probe: EnvProbe,
) -> None:
    path = mixed_dtype_checkpoint
    if method is LoadMethod.CONVERTED:
        path = make_converted(mixed_dtype_checkpoint, tmp_path / "conv", 2)
    checkpoint = open_checkpoint(path)
    plan = plan_shards(checkpoint, 2).ranks[0]
    timer = PhaseTimer()
    BACKENDS[method](probe, checkpoint=checkpoint).load(plan, CPU, timer)
    names = [r.name for r in timer.records]
    assert names == ["rank.read", "rank.to_device", "rank.sync"]
    assert set(names) <= set(PHASES)
    assert all(r.end_ns >= r.start_ns for r in timer.records)


# --- reader planning ------------------------------------------------------------------


def test_plan_reads_merges_file_contiguous_segments_into_one_scatter_read() -> None:
    segs = [Segment("f", 100, 10, 0, 0, "a"), Segment("f", 110, 20, 1, 0, "b")]
    [read] = plan_reads(segs, 1 << 20)
    assert (read.offset, read.length, len(read.segments)) == (100, 30, 2)


def test_plan_reads_keeps_strided_rows_and_other_files_apart() -> None:
    segs = [
        Segment("f", 0, 8, 0, 0, "a"),
        Segment("f", 16, 8, 0, 8, "a"),  # the next row of a split-1 shard
        Segment("g", 24, 8, 1, 0, "b"),  # touches in offset, but another file
    ]
    assert [(r.file, r.offset, r.length) for r in plan_reads(segs, 1 << 20)] == [
        ("f", 0, 8),
        ("f", 16, 8),
        ("g", 24, 8),
    ]


def test_plan_reads_splits_a_large_segment_into_chunks_with_right_targets() -> None:
    reads = plan_reads([Segment("f", 1000, 10_000, 3, 50, "big")], 4096)
    assert [(r.offset, r.length) for r in reads] == [(1000, 4096), (5096, 4096), (9192, 1808)]
    assert [r.segments[0].target_offset for r in reads] == [50, 4146, 8242]
    assert all(r.segments[0].target == 3 for r in reads)


def test_shard_segments_turns_split1_rows_into_one_strided_segment() -> None:
    rows = tuple(ByteRange("f", 100 + i * 48 + 24, 24) for i in range(8))
    shard = TensorShard("m", "F32", (8, 12), (8, 6), 1, rows)
    [seg] = shard_segments([shard])
    assert (seg.offset, seg.length, seg.row, seg.stride) == (124, 192, 24, 48)


def test_shard_segments_takes_planned_row_ranges_as_one_strided_segment() -> None:
    rows = RowRanges("f", 124, 24, 48, 8)
    [seg] = shard_segments([TensorShard("m", "F32", (8, 12), (8, 6), 1, rows)])
    assert (seg.offset, seg.length, seg.row, seg.stride) == (124, 192, 24, 48)


def test_shard_segments_keeps_irregular_ranges_apart() -> None:
    ranges = (ByteRange("f", 0, 8), ByteRange("f", 16, 8), ByteRange("f", 40, 8))
    shard = TensorShard("x", "U8", (24,), (24,), None, ranges)
    segs = shard_segments([shard])
    assert [(s.offset, s.length, s.target_offset, s.row) for s in segs] == [
        (0, 16, 0, 8),  # two rows 16 apart
        (40, 8, 16, 0),
    ]


def test_plan_reads_splits_strided_rows_on_row_boundaries() -> None:
    seg = Segment("f", 0, 10 * 1000, 0, 0, "m", row=1000, stride=4000)
    reads = plan_reads([seg], 4096)
    assert [(r.offset, r.length, r.row) for r in reads] == [
        (0, 4000, 1000),
        (16000, 4000, 1000),
        (32000, 2000, 1000),
    ]
    assert [r.segments[0].target_offset for r in reads] == [0, 4000, 8000]


def test_plan_reads_splits_a_row_longer_than_a_chunk() -> None:
    # A CUDA staging buffer is one chunk: no read may be longer, even for one row.
    seg = Segment("f", 0, 2 * 10000, 0, 0, "m", row=10000, stride=40000)
    reads = plan_reads([seg], 4096)
    assert max(r.length for r in reads) <= 4096
    assert [(r.offset, r.length, r.row) for r in reads] == [
        (0, 4096, 0),
        (4096, 4096, 0),
        (8192, 1808, 0),
        (40000, 4096, 0),
        (44096, 4096, 0),
        (48192, 1808, 0),
    ]
    assert [r.segments[0].target_offset for r in reads] == [0, 4096, 8192, 10000, 14096, 18192]


def test_plan_reads_drops_empty_segments() -> None:
    assert plan_reads([Segment("f", 0, 0, 0, 0, "empty")], 4096) == []


# --- converted ------------------------------------------------------------------------


@pytest.fixture
def converted(
    mixed_dtype_checkpoint: Path, make_converted: Callable[[Path, Path, int], Path], tmp_path: Path
) -> Path:
    return make_converted(mixed_dtype_checkpoint, tmp_path / "tp2", 2)


def test_converted_reads_whole_rank_files_and_verifies_them(
    converted: Path, mixed_dtype_checkpoint: Path, reference_shard: Reference, probe: EnvProbe
) -> None:
    checkpoint = open_checkpoint(converted)
    plan = plan_shards(checkpoint, 2).ranks[1]
    result = BACKENDS[LoadMethod.CONVERTED](probe, checkpoint=checkpoint).load(
        plan, CPU, PhaseTimer()
    )
    assert result.bytes_read == sum(os.path.getsize(f) for f in plan.files)
    assert (result.effective, result.fallback_reason) == (LoadMethod.CONVERTED, None)
    for shard in plan.shards:
        want = reference_shard(mixed_dtype_checkpoint, 1, 2, shard.name, shard.split)
        assert torch.equal(raw(result.tensors[shard.name]), raw(want)), shard.name


def test_converted_raises_naming_file_when_checksum_is_wrong(
    converted: Path, probe: EnvProbe
) -> None:
    checkpoint = open_checkpoint(converted)
    plan = plan_shards(checkpoint, 2).ranks[0]
    victim = plan.files[0]
    with open(victim, "r+b") as f:  # flip one byte of tensor data, size unchanged
        f.seek(plan.shards[0].ranges[0].offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="re-run `rayload convert`") as info:
        BACKENDS[LoadMethod.CONVERTED](probe, checkpoint=checkpoint).load(plan, CPU, PhaseTimer())
    assert info.value.file == victim
    assert "CRC-32" in str(info.value)


@pytest.mark.parametrize("where", ["first", "last"])
def test_converted_small_chunks_still_catch_a_flipped_byte(
    converted: Path, probe: EnvProbe, where: str
) -> None:
    """4 KiB chunks: the file's CRC-32 is combined from many per-chunk CRC-32s."""
    checkpoint = open_checkpoint(converted)
    plan = plan_shards(checkpoint, 2).ranks[0]
    backend = BACKENDS[LoadMethod.CONVERTED](
        probe, checkpoint=checkpoint, options=ReaderOptions(threads=3, chunk_bytes=4096)
    )
    backend.load(plan, CPU, PhaseTimer())  # intact: the combined CRC-32 matches
    victim = plan.files[0]
    at = 9 if where == "first" else os.path.getsize(victim) - 1  # header / last data byte
    with open(victim, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match="CRC-32") as info:
        backend.load(plan, CPU, PhaseTimer())
    assert info.value.file == victim


def test_converted_raises_naming_file_when_size_differs(converted: Path, probe: EnvProbe) -> None:
    checkpoint = open_checkpoint(converted)
    plan = plan_shards(checkpoint, 2).ranks[1]
    with open(plan.files[0], "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match="re-run `rayload convert`") as info:
        BACKENDS[LoadMethod.CONVERTED](probe, checkpoint=checkpoint).load(plan, CPU, PhaseTimer())
    assert info.value.file == plan.files[0]


def test_converted_refuses_plan_for_another_tp(converted: Path, probe: EnvProbe) -> None:
    checkpoint = open_checkpoint(converted)
    plan = plan_shards(checkpoint, 2).ranks[0]
    other = RankPlan(0, 4, plan.shards)
    with pytest.raises(CheckpointError, match="converted for tp_size=2") as info:
        BACKENDS[LoadMethod.CONVERTED](probe, checkpoint=checkpoint).load(other, CPU, PhaseTimer())
    assert info.value.file == str(converted / "rayload-manifest.json")


def test_converted_refuses_another_ranks_file(converted: Path, probe: EnvProbe) -> None:
    checkpoint = open_checkpoint(converted)
    plan = plan_shards(checkpoint, 2)
    swapped = RankPlan(0, 2, plan.ranks[1].shards)
    with pytest.raises(CheckpointError, match="not one of rank 0's files"):
        BACKENDS[LoadMethod.CONVERTED](probe, checkpoint=checkpoint).load(
            swapped, CPU, PhaseTimer()
        )


def test_converted_needs_a_converted_checkpoint(
    mixed_dtype_checkpoint: Path, probe: EnvProbe
) -> None:
    plan = plan_shards(mixed_dtype_checkpoint, 2).ranks[0]
    with pytest.raises(ConfigError, match="needs a converted checkpoint"):
        BACKENDS[LoadMethod.CONVERTED](probe).load(plan, CPU, PhaseTimer())


# --- fastsafetensors ------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "split"), [(2, 0), (3, 1), (2, None)])
def test_fastsafetensors_slices_hand_built_plan_bit_identical(
    matrix_file: tuple[Path, torch.Tensor], probe: EnvProbe, tp: int, split: int | None
) -> None:
    path, matrix = matrix_file
    for rank in range(tp):
        result = BACKENDS[LoadMethod.FASTSAFETENSORS](probe).load(
            hand_plan(path, rank, tp, split), CPU, PhaseTimer()
        )
        got = result.tensors["matrix"]
        expected = matrix if split is None else torch.tensor_split(matrix, tp, split)[rank]
        assert torch.equal(got, expected)
        assert got.is_contiguous()
        assert result.bytes_read == matrix.numel() * 4  # fastsafetensors reads whole tensors
        assert (result.effective, result.fallback_reason) == (LoadMethod.FASTSAFETENSORS, None)


@pytest.mark.parametrize("split", [0, 1], ids=["split-0 rows", "split-1 columns"])
def test_fastsafetensors_shard_owns_its_memory(
    matrix_file: tuple[Path, torch.Tensor], probe: EnvProbe, split: int
) -> None:
    # A split-0 piece is contiguous in the file buffer: it must still be a copy of its own.
    path, matrix = matrix_file
    result = BACKENDS[LoadMethod.FASTSAFETENSORS](probe).load(
        hand_plan(path, 1, 2, split), CPU, PhaseTimer()
    )
    shard = result.tensors["matrix"]
    assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size()
    assert torch.equal(shard, matrix.chunk(2, dim=split)[1])


def test_gdr_backend_reports_fastsafetensors_silent_cpu_copier_fallback(
    matrix_file: tuple[Path, torch.Tensor], probe: EnvProbe
) -> None:
    if probe.gds_available:
        pytest.skip("GDS is available here: fastsafetensors does not fall back")
    path, matrix = matrix_file
    result = FastsafetensorsGdrBackend(probe).load(hand_plan(path, 0, 2, 0), CPU, PhaseTimer())
    assert torch.equal(result.tensors["matrix"], matrix[:4])
    assert result.effective is LoadMethod.FASTSAFETENSORS
    assert result.fallback_reason is not None
    assert "NoGdsFileCopier instead of GPUDirect Storage" in result.fallback_reason


def test_gdr_effective_inferred_from_probe_without_copier_class() -> None:
    backend = FastsafetensorsGdrBackend(EnvProbe(cufile_loadable=True))
    effective, reason = backend._effective(None, [])
    assert effective is LoadMethod.FASTSAFETENSORS
    assert reason is not None and "/dev/nvidia-fs*" in reason
    with_gds = FastsafetensorsGdrBackend(EnvProbe(cufile_loadable=True, nvidia_fs_present=True))
    assert with_gds._effective(None, []) == (LoadMethod.FASTSAFETENSORS_GDR, None)


def test_gdr_effective_catches_per_file_gds_handle_fallback() -> None:
    backend = FastsafetensorsGdrBackend(EnvProbe())
    note = "GDS file-handle setup failed (overlayfs); falling back to the nogds copier"
    effective, reason = backend._effective("GdsFileCopier", [note])
    assert effective is LoadMethod.FASTSAFETENSORS
    assert reason is not None and "overlayfs" in reason
    assert backend._effective("GdsFileCopier", []) == (LoadMethod.FASTSAFETENSORS_GDR, None)


def test_gdr_backend_asks_for_gdr_copier_only_where_supported() -> None:
    released = FastsafetensorsGdrBackend(EnvProbe(fastsafetensors_copier_types=("gds", "nogds")))
    assert released._loader_options() == {"nogds": False}
    newer = FastsafetensorsGdrBackend(
        EnvProbe(fastsafetensors_copier_type_arg=True, fastsafetensors_copier_types=("gdr",))
    )
    assert newer._loader_options() == {"copier_type": "gdr"}


# --- dummy ----------------------------------------------------------------------------


def test_dummy_reads_nothing_and_is_deterministic(tmp_path: Path, probe: EnvProbe) -> None:
    missing = str(tmp_path / "does-not-exist.safetensors")
    shards = tuple(
        TensorShard(name, dtype, shape, shape, None, (ByteRange(missing, 8, 64),))
        for name, dtype, shape in [
            ("w", "BF16", (4, 8)),
            ("b", "F32", (8,)),
            ("ids", "I32", (2, 3)),
            ("mask", "BOOL", (5,)),
        ]
    )
    backend = BACKENDS[LoadMethod.DUMMY](probe)
    first = backend.load(RankPlan(0, 2, shards), CPU, PhaseTimer())
    again = backend.load(RankPlan(0, 2, shards), CPU, PhaseTimer())
    other_rank = backend.load(RankPlan(1, 2, shards), CPU, PhaseTimer())
    assert first.bytes_read == 0
    assert [(t.dtype, tuple(t.shape)) for t in first.tensors.values()] == [
        (torch.bfloat16, (4, 8)),
        (torch.float32, (8,)),
        (torch.int32, (2, 3)),
        (torch.bool, (5,)),
    ]
    for name in first.tensors:
        assert torch.equal(first.tensors[name], again.tensors[name])
    assert not torch.equal(first.tensors["w"], other_rank.tensors["w"])


# --- GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method", [LoadMethod.SCRATCH, LoadMethod.FASTSAFETENSORS])
def test_backend_loads_onto_cuda_bit_identical(
    method: LoadMethod, mixed_dtype_checkpoint: Path, reference_shard: Reference, probe: EnvProbe
) -> None:
    plan = plan_shards(mixed_dtype_checkpoint, 2).ranks[1]
    options = ReaderOptions(chunk_bytes=4096, staging_buffers=2)  # exercise buffer reuse
    result = BACKENDS[method](probe, options=options).load(plan, "cuda", PhaseTimer())
    for shard in plan.shards:
        got = result.tensors[shard.name]
        assert got.device == torch.device("cuda", 0)
        want = reference_shard(mixed_dtype_checkpoint, 1, 2, shard.name, shard.split)
        assert torch.equal(raw(got.cpu()), raw(want)), shard.name


@pytest.mark.gpu
@gpu
def test_load_rank_into_cuda_tensors_reads_straight_into_them(
    mixed_dtype_checkpoint: Path, reference_shard: Reference
) -> None:
    """An engine's CUDA parameters as the destinations (vLLM's, model=): auto reads into
    them through the pinned window, allocating nothing on the device beside them."""
    from rayload.loading import load_rank
    from rayload.loading.dtypes import torch_dtype

    plan = plan_shards(mixed_dtype_checkpoint, 2).ranks[1]
    into = {
        s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device="cuda") for s in plan.shards
    }
    pointers = {name: t.data_ptr() for name, t in into.items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    tensors, report = load_rank(mixed_dtype_checkpoint, 1, 2, "auto", "cuda", into=into)
    assert torch.cuda.memory_allocated() == before
    assert report.method.effective is LoadMethod.SCRATCH
    for shard in plan.shards:
        got = tensors[shard.name]
        assert got.data_ptr() == pointers[shard.name], shard.name
        want = reference_shard(mixed_dtype_checkpoint, 1, 2, shard.name, shard.split)
        assert torch.equal(raw(got.cpu()), raw(want)), shard.name


@pytest.mark.gpu
@gpu
def test_gdr_backend_on_cuda_reports_what_ran(
    mixed_dtype_checkpoint: Path, reference_shard: Reference, probe: EnvProbe
) -> None:
    plan = plan_shards(mixed_dtype_checkpoint, 2).ranks[0]
    result = FastsafetensorsGdrBackend(probe).load(plan, "cuda", PhaseTimer())
    for shard in plan.shards:
        want = reference_shard(mixed_dtype_checkpoint, 0, 2, shard.name, shard.split)
        assert torch.equal(raw(result.tensors[shard.name].cpu()), raw(want)), shard.name
    if probe.gds_available:
        assert result.effective in (LoadMethod.FASTSAFETENSORS_GDR, LoadMethod.FASTSAFETENSORS)
    else:
        assert result.effective is LoadMethod.FASTSAFETENSORS
        assert result.fallback_reason is not None
