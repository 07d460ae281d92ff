from __future__ import annotations

import pytest

from rayload.actors.hooks import FaultInjection, FaultyTimer, TestHooks, hooks_from_env
from rayload.errors import ConfigError


def test_hooks_from_env_is_empty_when_unset() -> None:
    assert hooks_from_env({}) == TestHooks()
    assert hooks_from_env({"RAYLOAD_TEST_HOOKS": "  "}).fault is None


def test_hooks_from_env_parses_fault_and_skew() -> None:
    raw = '{"fault": {"rank": 1, "action": "exit"}, "clock_skew_ns": {"1": 5e9}}'
    hooks = hooks_from_env({"RAYLOAD_TEST_HOOKS": raw})
    assert hooks.fault_for(1) == FaultInjection(rank=1, action="exit")
    assert hooks.fault_for(0) is None
    assert hooks.clock_skew_ns == {1: 5_000_000_000}


@pytest.mark.parametrize(
    "raw",
    [
        "{not json",
        '{"fault": {"rank": 1, "action": "melt"}}',
        '{"x": 1}',
        '{"probe_overrides": {"1": {"gds": true}}}',  # EnvProbe has no field "gds"
    ],
)
def test_hooks_from_env_rejects_bad_value_with_config_error(raw: str) -> None:
    with pytest.raises(ConfigError, match="RAYLOAD_TEST_HOOKS"):
        hooks_from_env({"RAYLOAD_TEST_HOOKS": raw})


def test_hooks_from_env_parses_probe_overrides_per_rank() -> None:
    raw = '{"probe_overrides": {"1": {"nvidia_fs_present": true}}}'
    hooks = hooks_from_env({"RAYLOAD_TEST_HOOKS": raw})
    assert hooks.probe_overrides == {1: {"nvidia_fs_present": True}}


def test_faulty_timer_records_failed_phase_and_raises() -> None:
    timer = FaultyTimer(FaultInjection(rank=0, phase="rank.read"), clock=iter(range(100)).__next__)
    with timer.phase("rank.plan"):
        pass
    with (
        pytest.raises(RuntimeError, match=r"injected fault in rank\.read"),
        timer.phase("rank.read"),
    ):
        pass
    assert [(r.name, r.error is not None) for r in timer.records] == [
        ("rank.plan", False),
        ("rank.read", True),
    ]
