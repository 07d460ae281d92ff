"""Each option is checked once (rayload.options): the CLI, the Python API, the rank loader
and the planner give the same message for the same bad value, before any Ray starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import rayload
from rayload.errors import ConfigError
from rayload.loading import load_rank, plan_shards
from rayload.placement import rank_bundles
from support.cli import assert_one_line_error, run_cli


def _message(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("tp", [0, -2])
def test_bad_tp_size_same_message_everywhere(tiny_llama: Path, tp: int) -> None:
    want = f"tp_size must be a positive integer, got {tp}"
    assert _message(rayload.load, tiny_llama, tp) == want
    assert _message(plan_shards, tiny_llama, tp) == want
    assert _message(load_rank, tiny_llama, 0, tp) == want
    assert _message(rank_bundles, tp, use_gpus=False) == want
    for command in ("plan", "load"):
        assert_one_line_error(run_cli(command, str(tiny_llama), "--tp", str(tp)), want)


def test_bad_method_same_message_everywhere(tiny_llama: Path) -> None:
    want = "unknown load method 'bogus'; valid values: auto, "
    assert _message(rayload.load, tiny_llama, 2, method="bogus").startswith(want)
    assert _message(load_rank, tiny_llama, 0, 2, method="bogus").startswith(want)
    assert_one_line_error(run_cli("load", str(tiny_llama), "--tp", "2", "--method", "bogus"), want)


def test_bad_model_role_same_message_everywhere(tiny_llama: Path) -> None:
    want = "model_role must be one of main, draft, got 'critic'"
    assert _message(rayload.load, tiny_llama, 2, model_role="critic") == want
    assert _message(load_rank, tiny_llama, 0, 2, model_role="critic") == want


def test_bad_device_and_strategy_same_message_in_api_and_actor_side(tiny_llama: Path) -> None:
    from rayload.actors.device import rank_device

    want = "device must be one of auto, cpu, cuda, got 'tpu'"
    assert _message(rayload.load, tiny_llama, 2, device="tpu") == want
    assert _message(rank_device, "tpu", gpu_ids=(), cuda_device_count=0, rank=0) == want
    want = "unknown placement strategy 'DIAGONAL'; use one of: STRICT_PACK, PACK, SPREAD"
    assert _message(rayload.load, tiny_llama, 2, placement_strategy="DIAGONAL").startswith(want)
    from rayload.placement.bundles import unmet_resources

    assert _message(unmet_resources, [], "DIAGONAL", []).startswith(want)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_shared_copy_must_be_true_or_false(tiny_llama: Path, value: object) -> None:
    # Checked in the driver before any Ray starts: 1 is not taken for True.
    want = f"shared_copy must be True or False, got {value!r}"
    assert _message(rayload.load, tiny_llama, 2, shared_copy=value) == want
