"""The pure parts of the driver-side group: turning a failure into the error it raises."""

from __future__ import annotations

import pytest

from rayload.actors.rank_group import RankFailure, failure_error
from rayload.errors import (
    CheckpointError,
    InputError,
    MethodUnavailableError,
    RankFailedError,
    RankTimeoutError,
)


def test_failure_error_for_raised_rank_names_rank_node_and_cause() -> None:
    error = failure_error(RankFailure(2, "abc123", "raised", "OSError: disk gone"), timeout_s=9)
    assert isinstance(error, RankFailedError)
    assert (error.rank, error.node_id, error.cause) == (2, "abc123", "OSError: disk gone")
    assert str(error) == "rank 2 on node abc123 failed: OSError: disk gone"


def test_failure_error_for_timeout_says_timeout_and_what_to_do() -> None:
    failure = RankFailure(1, None, "timeout", "did not load in time (ranks still running: [1])")
    error = failure_error(failure, timeout_s=30)
    assert isinstance(error, RankTimeoutError)
    assert (error.rank, error.node_id, error.timeout_s) == (1, None, 30)
    assert "rank 1 on node unknown" in str(error) and "timed out after 30 s" in str(error)


@pytest.mark.parametrize(
    "input_error",
    [MethodUnavailableError("GDS is not available"), CheckpointError("bad", file="/x", tensor="w")],
)
def test_failure_error_keeps_rank_input_error_class_and_fields(input_error: InputError) -> None:
    failure = RankFailure(0, "n0", "raised", "x", input_error=input_error)
    error = failure_error(failure, timeout_s=1)
    assert type(error) is type(input_error)
    assert str(error) == f"rank 0 on node n0: {input_error}"
    assert vars(error) == {**vars(input_error), "rank": 0, "node_id": "n0"}
    assert (error.rank, error.node_id) == (0, "n0")
    assert (input_error.rank, input_error.node_id) == (None, None)
    assert str(input_error) != str(error), "the original is left untouched"
