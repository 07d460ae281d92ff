"""The session's S3 server (moto behind the counting, fault-injecting proxy of
tests/support/s3.py) and checkpoints uploaded to it once per session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rayload.loading.convert import convert_checkpoint
from support.s3 import S3Server, s3_server


@pytest.fixture(scope="session")
def s3() -> S3Server:
    return s3_server()


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[Any]:
    """The proxy, its log and faults cleared before and after the test."""
    s3.proxy.clear()
    yield s3.proxy
    s3.proxy.clear()


@pytest.fixture(scope="session")
def s3_checkpoints(
    s3: S3Server,
    reference: Callable[[str], Any],
    tiny_llama: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, str]]:
    """layout -> (local directory, its s3:// copy): ``single`` (a transformers Llama, one
    model.safetensors), ``index`` (rayload's tiny Llama, an index over 2 files) and
    ``converted`` (that one converted for tp 2)."""
    converted = convert_checkpoint(tiny_llama, tmp_path_factory.mktemp("conv") / "tp2", 2)
    local = {"single": reference("llama_gqa").path, "index": tiny_llama, "converted": converted}
    return {
        layout: (Path(path), s3.upload(Path(path), "models", layout))
        for layout, path in local.items()
    }
