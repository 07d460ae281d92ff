"""Reading a checkpoint into a rank's resident tensors, in place (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rayload.errors import CheckpointError
from rayload.loading import convert_checkpoint, load_rank, plan_shards, write_checkpoint
from rayload.loading.backends import BACKENDS
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import same_plan_problem
from rayload.loading.probe import probe_environment
from rayload.loading.rank import reload_rank
from rayload.loading.report import PhaseTimer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("reload")
    return write_checkpoint(root / "a", seed=1), write_checkpoint(root / "b", seed=2)


@pytest.mark.parametrize("method", ["scratch", "dummy"])
def test_reload_rank_writes_into_the_same_tensors(
    checkpoints: tuple[Path, Path], method: str
) -> None:
    a, b = checkpoints
    tensors, _ = load_rank(a, 1, 2)
    pointers = {name: t.data_ptr() for name, t in tensors.items()}
    resident = dict(tensors)
    report = reload_rank(b, 1, 2, tensors, method)
    assert {name: t.data_ptr() for name, t in tensors.items()} == pointers
    assert all(tensors[name] is resident[name] for name in tensors)
    expected, _ = load_rank(b, 1, 2, method)
    for name, tensor in expected.items():
        assert torch.equal(tensors[name], tensor), name
    copied = [p for p in report.phases if p.attributes.get("copied_into_resident")]
    assert bool(copied) == (method != "scratch"), "only scratch reads straight in"


def test_reload_rank_of_other_shapes_raises_before_writing(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = checkpoints
    other = write_checkpoint(tmp_path / "small", size_gb=0.001, seed=3)
    tensors, _ = load_rank(a, 0, 2)
    before = {name: t.clone() for name, t in tensors.items()}
    written: set[str] = set()
    with pytest.raises(CheckpointError) as caught:
        reload_rank(other, 0, 2, tensors, written=written)
    assert caught.value.tensor
    assert not written
    assert all(torch.equal(tensors[n], before[n]) for n in before)


def test_same_plan_problem_names_the_first_differing_tensor(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = checkpoints
    assert same_plan_problem(plan_shards(a, 2), plan_shards(b, 2)) is None
    f32 = write_checkpoint(tmp_path / "f32", dtype="f32", seed=1)
    problem = same_plan_problem(plan_shards(a, 2), plan_shards(f32, 2))
    assert problem is not None
    tensor, message = problem
    assert tensor in message and "F32" in message


def test_scratch_read_that_fails_midway_says_what_it_had_written(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = checkpoints
    b = write_checkpoint(tmp_path / "b", seed=9, num_files=2)
    tensors, _ = load_rank(a, 0, 2)
    checkpoint = open_checkpoint(b)
    plan = plan_shards(checkpoint, 2).ranks[0]
    last_file = max(plan.files)
    with open(last_file, "r+b") as f:  # the headers were read: the data is now short
        f.truncate(Path(last_file).stat().st_size // 2)
    backend = BACKENDS[LoadMethod.SCRATCH](probe_environment(), checkpoint=checkpoint)
    written: set[str] = set()
    with pytest.raises(CheckpointError):
        backend.load(plan, "cpu", PhaseTimer(), into=tensors, written=written)
    in_last = {s.name for s in plan.shards if s.ranges and s.ranges[0].file == last_file}
    assert written and written & in_last
    assert written <= {s.name for s in plan.shards}


def test_reload_rank_of_a_converted_checkpoint_reads_straight_in(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = checkpoints
    convert_checkpoint(a, tmp_path / "a", 2)
    convert_checkpoint(b, tmp_path / "b", 2)
    tensors, _ = load_rank(tmp_path / "a", 0, 2, "converted")
    pointers = {name: t.data_ptr() for name, t in tensors.items()}
    report = reload_rank(tmp_path / "b", 0, 2, tensors, "converted")
    assert {name: t.data_ptr() for name, t in tensors.items()} == pointers
    assert not any(p.attributes.get("copied_into_resident") for p in report.phases)
    expected, _ = load_rank(b, 0, 2)
    for name, tensor in expected.items():
        assert torch.equal(tensors[name], tensor), name
