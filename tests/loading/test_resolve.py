"""Every branch of the load-method decision table (docs/load-methods.md), on synthetic
probes: no GPU needed."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from rayload.errors import CheckpointError, ConfigError, MethodUnavailableError
from rayload.loading.methods import LoadMethod
from rayload.loading.probe import EnvProbe
from rayload.loading.resolve import (
    LayoutInfo,
    Resolution,
    log_fallback,
    resolve_device,
    resolve_method,
)

CPU_ONLY = EnvProbe(fastsafetensors_version="0.5.0")
NO_FST = EnvProbe()
GPU_NO_GDS = EnvProbe(
    cuda_available=True,
    device_count=1,
    device_name="H100",
    pinned_memory=True,
    fastsafetensors_version="0.5.0",
)
GPU_GDS = dataclasses.replace(GPU_NO_GDS, cufile_loadable=True, nvidia_fs_present=True)
GPU_GDS_NO_FST = dataclasses.replace(GPU_GDS, fastsafetensors_version=None)
GPU_CUFILE_NO_NODE = dataclasses.replace(GPU_NO_GDS, cufile_loadable=True)

HF = LayoutInfo("hf_index", "/ckpt/hf")
CONVERTED_TP2 = LayoutInfo("converted", "/ckpt/tp2", converted_tp_size=2)


def resolve(
    method: LoadMethod | str,
    probe: EnvProbe,
    layout: LayoutInfo = HF,
    *,
    tp: int = 2,
    device: str = "auto",
    strict: bool = False,
) -> Resolution:
    return resolve_method(method, probe, layout, tp_size=tp, device=device, strict=strict)


# --- auto -------------------------------------------------------------------------------


def test_auto_selects_converted_when_converted_for_this_tp() -> None:
    res = resolve("auto", GPU_GDS, CONVERTED_TP2)
    assert (res.selected, res.fallback_reason) == (LoadMethod.CONVERTED, None)
    assert "tp_size=2" in res.reason


def test_auto_selects_gdr_when_cuda_gds_and_fastsafetensors() -> None:
    res = resolve("auto", GPU_GDS)
    assert res == Resolution(
        LoadMethod.AUTO,
        LoadMethod.FASTSAFETENSORS_GDR,
        "cuda:0",
        "CUDA device, GPUDirect Storage and fastsafetensors are available",
    )


@pytest.mark.parametrize(
    ("probe", "missing"),
    [
        (GPU_NO_GDS, "libcufile cannot be loaded"),
        (GPU_CUFILE_NO_NODE, "/dev/nvidia-fs"),
        (GPU_GDS_NO_FST, "fastsafetensors is not installed"),
    ],
)
def test_auto_selects_scratch_when_gpu_lacks_direct_path(probe: EnvProbe, missing: str) -> None:
    res = resolve("auto", probe)
    assert (res.selected, res.device, res.fallback_reason) == (LoadMethod.SCRATCH, "cuda:0", None)
    assert missing in res.reason


def test_auto_selects_scratch_on_cpu_even_with_gds() -> None:
    res = resolve("auto", GPU_GDS, device="cpu")
    assert (res.selected, res.device) == (LoadMethod.SCRATCH, "cpu")
    assert "cpu" in res.reason


def test_auto_into_given_device_memory_reads_straight_into_it_even_with_gds() -> None:
    """An engine's parameters, resident tensors: fastsafetensors reads into buffers of its
    own, which would then be copied; rayload's reader writes into the memory given."""
    res = resolve_method("auto", GPU_GDS, HF, tp_size=2, device="auto", strict=True, into=True)
    assert (res.selected, res.device, res.fallback_reason) == (LoadMethod.SCRATCH, "cuda:0", None)
    assert "straight into it" in res.reason
    converted = resolve_method(
        "auto", GPU_GDS, CONVERTED_TP2, tp_size=2, device="auto", strict=True, into=True
    )
    assert converted.selected is LoadMethod.CONVERTED


def test_auto_never_falls_back_even_when_strict() -> None:
    assert resolve("auto", NO_FST, strict=True).fallback_reason is None


# --- explicit methods that run as asked ------------------------------------------------


@pytest.mark.parametrize(
    ("method", "probe", "layout"),
    [
        ("scratch", NO_FST, HF),
        ("dummy", NO_FST, HF),
        ("converted", NO_FST, CONVERTED_TP2),
        ("fastsafetensors", CPU_ONLY, HF),
        ("fastsafetensors", GPU_NO_GDS, HF),
        ("fastsafetensors_gdr", GPU_GDS, HF),
        ("fastsafetensors", CPU_ONLY, CONVERTED_TP2),
        ("fastsafetensors_gdr", GPU_GDS, CONVERTED_TP2),
        ("dummy", NO_FST, CONVERTED_TP2),
    ],
)
def test_requested_method_is_selected_when_it_can_run(
    method: str, probe: EnvProbe, layout: LayoutInfo
) -> None:
    res = resolve(method, probe, layout, strict=True)
    assert res.selected == res.requested == LoadMethod(method)
    assert res.fallback_reason is None


def test_requested_method_accepts_enum_value() -> None:
    assert resolve(LoadMethod.SCRATCH, NO_FST).selected is LoadMethod.SCRATCH


# --- fallbacks ------------------------------------------------------------------------


def test_converted_on_hf_layout_falls_back_to_scratch_with_convert_hint() -> None:
    res = resolve("converted", GPU_GDS, HF, tp=4)
    assert res.selected is LoadMethod.SCRATCH
    assert res.fallback_reason is not None
    assert "no rayload-manifest.json in /ckpt/hf" in res.fallback_reason
    assert "rayload convert /ckpt/hf OUT --tp 4" in res.fallback_reason


def test_scratch_on_converted_layout_resolves_to_converted_which_checks_crc() -> None:
    res = resolve("scratch", GPU_GDS, CONVERTED_TP2)
    assert (res.requested, res.selected) == (LoadMethod.SCRATCH, LoadMethod.CONVERTED)
    assert res.fallback_reason == (
        "checkpoint is pre-sharded by `rayload convert`: its rank files are read by the "
        "converted method, which verifies the manifest checksums"
    )


def test_fastsafetensors_missing_on_converted_layout_ends_at_converted() -> None:
    res = resolve("fastsafetensors", NO_FST, CONVERTED_TP2)
    assert res.selected is LoadMethod.CONVERTED
    assert res.fallback_reason is not None
    assert res.fallback_reason.startswith("fastsafetensors is not installed")
    assert "pre-sharded by `rayload convert`" in res.fallback_reason


@pytest.mark.parametrize("method", ["fastsafetensors", "fastsafetensors_gdr"])
def test_fastsafetensors_not_installed_falls_back_to_scratch(method: str) -> None:
    probe = dataclasses.replace(GPU_GDS_NO_FST, fastsafetensors_error="ImportError: no module")
    res = resolve(method, probe)
    assert res.selected is LoadMethod.SCRATCH
    assert res.fallback_reason == (
        "fastsafetensors is not installed (ImportError: no module); pip install fastsafetensors"
    )


def test_gdr_on_cpu_device_falls_back_to_bounce_buffer() -> None:
    res = resolve("fastsafetensors_gdr", GPU_GDS, device="cpu")
    assert (res.selected, res.device) == (LoadMethod.FASTSAFETENSORS, "cpu")
    assert res.fallback_reason is not None and "device is cpu" in res.fallback_reason


def test_gdr_without_cuda_falls_back_to_bounce_buffer_on_cpu() -> None:
    res = resolve("fastsafetensors_gdr", CPU_ONLY)
    assert (res.selected, res.device) == (LoadMethod.FASTSAFETENSORS, "cpu")


@pytest.mark.parametrize(
    ("probe", "missing"),
    [(GPU_NO_GDS, "libcufile cannot be loaded"), (GPU_CUFILE_NO_NODE, "no /dev/nvidia-fs*")],
)
def test_gdr_without_gds_falls_back_to_bounce_buffer(probe: EnvProbe, missing: str) -> None:
    res = resolve("fastsafetensors_gdr", probe)
    assert (res.selected, res.device) == (LoadMethod.FASTSAFETENSORS, "cuda:0")
    assert res.fallback_reason is not None
    assert res.fallback_reason.startswith("GPUDirect Storage is unavailable: ")
    assert missing in res.fallback_reason
    assert res.requested is LoadMethod.FASTSAFETENSORS_GDR


@pytest.mark.parametrize(
    ("method", "probe", "layout", "reason_part"),
    [
        ("converted", GPU_GDS, HF, "rayload-manifest.json"),
        ("scratch", NO_FST, CONVERTED_TP2, "pre-sharded by `rayload convert`"),
        ("fastsafetensors", NO_FST, HF, "not installed"),
        ("fastsafetensors_gdr", GPU_NO_GDS, HF, "GPUDirect Storage is unavailable"),
        ("fastsafetensors_gdr", CPU_ONLY, HF, "device is cpu"),
    ],
)
def test_fallback_raises_method_unavailable_when_strict(
    method: str, probe: EnvProbe, layout: LayoutInfo, reason_part: str
) -> None:
    with pytest.raises(MethodUnavailableError, match=reason_part) as info:
        resolve(method, probe, layout, strict=True)
    assert f"load method '{method}' cannot run here" in str(info.value)


def test_log_fallback_warns_with_rank_methods_and_reason(caplog: pytest.LogCaptureFixture) -> None:
    res = resolve("fastsafetensors", NO_FST)
    with caplog.at_level(logging.WARNING, logger="rayload.loading.resolve"):
        log_fallback(3, res.requested, res.selected, res.fallback_reason)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"rank 3: load method fastsafetensors falls back to scratch: {res.fallback_reason}"
    )


def test_log_fallback_is_quiet_without_fallback(caplog: pytest.LogCaptureFixture) -> None:
    res = resolve("scratch", NO_FST)
    with caplog.at_level(logging.DEBUG, logger="rayload.loading.resolve"):
        log_fallback(0, res.requested, res.selected, res.fallback_reason)
    assert caplog.records == []


def test_resolve_method_itself_does_not_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="rayload"):
        resolve("converted", NO_FST)
    assert caplog.records == []


# --- errors ---------------------------------------------------------------------------


def test_unknown_method_raises_config_error_listing_valid_values() -> None:
    with pytest.raises(ConfigError) as info:
        resolve("gds", GPU_GDS)
    message = str(info.value)
    assert "unknown load method 'gds'" in message
    for method in LoadMethod:
        assert method.value in message


def test_converted_for_other_tp_raises_checkpoint_error_naming_manifest() -> None:
    with pytest.raises(CheckpointError) as info:
        resolve("auto", GPU_GDS, CONVERTED_TP2, tp=4)
    assert info.value.file == "/ckpt/tp2/rayload-manifest.json"
    assert "converted for tp_size=2, not 4" in str(info.value)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_cuda_raises_config_error(device: str) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve("scratch", CPU_ONLY, device=device)


# --- devices --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "probe", "expected"),
    [
        ("auto", CPU_ONLY, "cpu"),
        ("auto", GPU_NO_GDS, "cuda:0"),
        ("cpu", GPU_NO_GDS, "cpu"),
        ("cuda", GPU_NO_GDS, "cuda:0"),
        ("cuda:0", GPU_NO_GDS, "cuda:0"),
    ],
)
def test_resolve_device_picks_local_device(device: str, probe: EnvProbe, expected: str) -> None:
    assert resolve_device(device, probe) == expected


def test_resolve_device_rejects_index_beyond_visible_devices() -> None:
    with pytest.raises(ConfigError, match="only 1 CUDA device"):
        resolve_device("cuda:1", GPU_NO_GDS)


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x"])
def test_resolve_device_rejects_unknown_device(device: str) -> None:
    with pytest.raises(ConfigError, match="use auto, cpu, cuda or cuda:N"):
        resolve_device(device, GPU_NO_GDS)


def test_layout_info_requires_tp_exactly_for_converted() -> None:
    with pytest.raises(ValueError):
        LayoutInfo("hf_single", "/x", converted_tp_size=2)
    with pytest.raises(ValueError):
        LayoutInfo("converted", "/x")


# --- peer: another replica holds this rank's shards -----------------------------------


def resolve_with_peer(
    method: LoadMethod | str,
    probe: EnvProbe,
    layout: LayoutInfo = HF,
    *,
    peer: bool,
    device: str = "auto",
    strict: bool = False,
) -> Resolution:
    return resolve_method(
        method, probe, layout, tp_size=2, device=device, strict=strict, peer_available=peer
    )


@pytest.mark.parametrize(
    ("probe", "layout", "storage"),
    [
        (CPU_ONLY, HF, LoadMethod.SCRATCH),
        (GPU_GDS, HF, LoadMethod.FASTSAFETENSORS_GDR),
        (GPU_NO_GDS, HF, LoadMethod.SCRATCH),
        (GPU_GDS, CONVERTED_TP2, LoadMethod.CONVERTED),
    ],
)
@pytest.mark.parametrize("method", ["auto", "peer"])
def test_auto_and_peer_select_peer_when_a_replica_holds_the_shard(
    method: str, probe: EnvProbe, layout: LayoutInfo, storage: LoadMethod
) -> None:
    res = resolve_with_peer(method, probe, layout, peer=True, strict=True)
    assert (res.selected, res.storage, res.fallback_reason) == (LoadMethod.PEER, storage, None)
    assert "another replica holds this rank's shards" in res.reason
    assert f"falling back to {storage.value}" in res.reason


def test_auto_without_a_peer_is_unchanged_and_reads_with_its_storage_method() -> None:
    res = resolve_with_peer("auto", GPU_GDS, peer=False)
    assert res == resolve("auto", GPU_GDS)
    assert res.storage is res.selected is LoadMethod.FASTSAFETENSORS_GDR


@pytest.mark.parametrize(
    ("probe", "layout", "storage"),
    [(CPU_ONLY, HF, LoadMethod.SCRATCH), (GPU_GDS, CONVERTED_TP2, LoadMethod.CONVERTED)],
)
def test_peer_without_a_peer_falls_back_to_what_auto_would_read_with(
    probe: EnvProbe, layout: LayoutInfo, storage: LoadMethod
) -> None:
    res = resolve_with_peer("peer", probe, layout, peer=False)
    assert (res.requested, res.selected, res.storage) == (LoadMethod.PEER, storage, storage)
    assert res.fallback_reason == (
        "no replica holding this checkpoint (same identity and plan) was found; read from storage"
    )


def test_peer_without_a_peer_under_strict_raises_method_unavailable() -> None:
    with pytest.raises(MethodUnavailableError, match="no replica holding this checkpoint"):
        resolve_with_peer("peer", CPU_ONLY, peer=False, strict=True)


@pytest.mark.parametrize(
    "method", [m for m in LoadMethod if m not in (LoadMethod.AUTO, LoadMethod.PEER)]
)
def test_requested_storage_methods_ignore_peers(method: LoadMethod) -> None:
    with_peer = resolve_with_peer(method, GPU_GDS, peer=True)
    assert with_peer == resolve_with_peer(method, GPU_GDS, peer=False)
    assert with_peer.selected is not LoadMethod.PEER
    assert with_peer.storage is with_peer.selected


def test_peer_with_a_converted_checkpoint_for_another_tp_still_raises() -> None:
    with pytest.raises(CheckpointError, match="converted for tp_size=2, not 4"):
        resolve_method(
            "peer", GPU_GDS, CONVERTED_TP2, tp_size=4, device="auto", strict=False,
            peer_available=True,
        )  # fmt: skip


def test_a_peer_resolution_must_name_its_storage_method() -> None:
    with pytest.raises(ValueError, match="storage method"):
        Resolution(LoadMethod.PEER, LoadMethod.PEER, "cpu", "peer")
