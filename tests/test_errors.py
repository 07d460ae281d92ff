"""The exception tree's errors survive pickling (a rank's error crosses Ray to the driver)."""

from __future__ import annotations

import copy
import pickle

import pytest

from rayload.errors import (
    ClusterLostError,
    RankTimeoutError,
    RayloadError,
    ShardingError,
    StorageError,
)


@pytest.mark.parametrize(
    "error",
    [
        StorageError("s3://b/k: no such object", url="s3://b/k", missing=True),
        ShardingError("w: not divisible", tensor="w", file="/m/a.safetensors"),
        RankTimeoutError("rank 1 timed out", rank=1, node_id="n1", timeout_s=8.0),
        ClusterLostError("head lost", phase="placing", address="1.2.3.4:6379", log_dir=None),
    ],
)
def test_errors_pickle_and_copy_with_their_message_and_attributes(error: RayloadError) -> None:
    error.rank, error.node_id = 1, "n1"  # what the driver adds to a rank's input error
    for twin in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(twin) is type(error) and twin.args == error.args
        assert vars(twin) == vars(error)
        assert twin.exit_code == error.exit_code
