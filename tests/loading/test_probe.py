"""The environment probe on this machine and with capabilities faked at the OS level."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import fastsafetensors
import pytest
import torch
from fastsafetensors import SafeTensorsFileLoader

from rayload.loading import probe as probe_module
from rayload.loading.probe import EnvProbe, probe_environment


def test_probe_reports_this_machines_cuda_state() -> None:
    probe = probe_environment()
    assert probe.cuda_available == torch.cuda.is_available()
    assert probe.device_count == (torch.cuda.device_count() if probe.cuda_available else 0)
    assert probe.device_index == 0
    if not probe.cuda_available:
        assert (probe.device_name, probe.device_total_memory, probe.pinned_memory) == (
            None,
            None,
            False,
        )


def test_probe_introspects_installed_fastsafetensors() -> None:
    probe = probe_environment()
    assert probe.fastsafetensors_installed
    assert probe.fastsafetensors_version == fastsafetensors.__version__
    accepts = "copier_type" in inspect.signature(SafeTensorsFileLoader.__init__).parameters
    assert probe.fastsafetensors_copier_type_arg is accepts
    assert {"gds", "nogds"} <= set(probe.fastsafetensors_copier_types)


def test_probe_reports_missing_fastsafetensors_without_raising(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "fastsafetensors", None)
    probe = probe_environment()
    assert not probe.fastsafetensors_installed
    assert probe.fastsafetensors_error is not None
    assert "fastsafetensors" in probe.fastsafetensors_error
    assert probe.fastsafetensors_copier_types == ()


def test_probe_finds_gds_when_cufile_loads_and_device_node_exists(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "nvidia-fs0").touch()
    monkeypatch.setattr(probe_module, "_NVIDIA_FS_GLOB", str(tmp_path / "nvidia-fs*"))
    monkeypatch.setattr(probe_module, "_CUFILE_SONAMES", ("libc.so.6",))
    probe = probe_environment()
    assert probe.cufile_loadable and probe.nvidia_fs_present
    assert probe.gds_available
    assert probe.gds_missing_reason is None


def test_probe_reports_missing_device_node_when_only_cufile_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(probe_module, "_NVIDIA_FS_GLOB", str(tmp_path / "nvidia-fs*"))
    monkeypatch.setattr(probe_module, "_CUFILE_SONAMES", ("libc.so.6",))
    probe = probe_environment()
    assert probe.cufile_loadable and not probe.gds_available
    assert probe.gds_missing_reason == f"no {tmp_path}/nvidia-fs* device node (nvidia-fs driver)"


def test_gds_missing_reason_names_both_parts_when_nothing_is_there() -> None:
    assert EnvProbe().gds_missing_reason == (
        "libcufile cannot be loaded; no /dev/nvidia-fs* device node (nvidia-fs driver)"
    )


def test_gdr_copier_needs_both_the_argument_and_the_registered_type() -> None:
    assert not EnvProbe(fastsafetensors_copier_types=("gdr",)).fastsafetensors_gdr_copier
    assert not EnvProbe(fastsafetensors_copier_type_arg=True).fastsafetensors_gdr_copier
    assert EnvProbe(
        fastsafetensors_copier_type_arg=True, fastsafetensors_copier_types=("gdr", "nogds")
    ).fastsafetensors_gdr_copier


_FRESH_LOADS = """
import json, sys
import rayload.loading, rayload.loading.probe
from rayload.loading import load_rank
seen = {"import": [None, "fastsafetensors" in sys.modules]}
for method in sys.argv[2:]:
    _, report = load_rank(sys.argv[1], 0, 2, method)
    seen[method] = [report.method.effective.value, "fastsafetensors" in sys.modules]
print(json.dumps(seen))
"""
_PROCESSES = (("scratch", "dummy"), ("auto",), ("fastsafetensors",))
"""The loads of each fresh interpreter: the methods that must not import fastsafetensors
share one (after the bare import), each that may import it has its own."""


@pytest.fixture(scope="module")
def fresh_loads(mixed_dtype_checkpoint: Path) -> dict[str, list[Any]]:
    """``{"import" or method: [effective method, fastsafetensors imported]}``, from fresh
    interpreters (sys.modules of this one has it already), run side by side."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FRESH_LOADS, str(mixed_dtype_checkpoint), *methods],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for methods in _PROCESSES
    ]
    seen: dict[str, list[Any]] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        seen.update(json.loads(out.splitlines()[-1]))
    return seen


def test_importing_loading_does_not_import_fastsafetensors(
    fresh_loads: dict[str, list[Any]],
) -> None:
    assert fresh_loads["import"] == [None, False], "fastsafetensors imported eagerly"


@pytest.mark.parametrize(
    ("method", "imported"),
    [("scratch", False), ("dummy", False), ("auto", True), ("fastsafetensors", True)],
)
def test_a_rank_load_imports_fastsafetensors_only_for_methods_that_may_use_it(
    fresh_loads: dict[str, list[Any]], method: str, imported: bool
) -> None:
    effective = "scratch" if method == "auto" else method  # auto on CPU: scratch
    assert fresh_loads[method] == [effective, imported]


def test_a_probe_without_fastsafetensors_says_it_was_not_probed() -> None:
    env = probe_environment(fastsafetensors=False)
    assert not env.fastsafetensors_installed
    assert env.fastsafetensors_error == probe_module.FASTSAFETENSORS_NOT_PROBED
    assert env.cuda_available == torch.cuda.is_available()
