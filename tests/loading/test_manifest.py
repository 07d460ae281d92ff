"""CRC-32 helpers of the converted manifest: the fast implementation and the combine."""

from __future__ import annotations

import itertools
import random
import zlib
from pathlib import Path

import pytest

from rayload.errors import CheckpointError
from rayload.loading.manifest import Crc32, crc32, crc32_combine, read_manifest


def test_crc32_matches_zlib_on_random_bytes() -> None:
    data = random.Random(1).randbytes(1 << 20)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[100:], crc32(data[:100])) == zlib.crc32(data)


@pytest.mark.parametrize(
    "len1, len2", [(0, 0), (0, 5), (5, 0), (1, 1), (300, 70_001), (4096, 1 << 20)]
)
def test_crc32_combine_equals_crc32_of_concatenation(len1: int, len2: int) -> None:
    rng = random.Random(len1 * 31 + len2)
    a, b = rng.randbytes(len1), rng.randbytes(len2)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_extend_with_pieces_equals_update_in_order() -> None:
    data = random.Random(2).randbytes(50_000)
    cuts = [0, 1, 4096, 4097, 30_000, 50_000]
    by_update, by_extend = Crc32(), Crc32()
    for start, end in itertools.pairwise(cuts):
        by_update.update(data[start:end])
        by_extend.extend(zlib.crc32(data[start:end]), end - start)
    assert by_extend.hexdigest() == by_update.hexdigest() == f"{zlib.crc32(data):08x}"


def test_crc32_combine_detects_a_changed_piece() -> None:
    a, b = b"tensor bytes", b"more tensor bytes"
    good = crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b"more tensor bytez"), len(b)) != good


def test_read_manifest_deeply_nested_json_is_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "rayload-manifest.json"
    path.write_text("[" * 100_000)
    with pytest.raises(CheckpointError) as info:
        read_manifest(str(path))
    assert str(path) in str(info.value)
