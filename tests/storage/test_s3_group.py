"""One TP group from ``s3://`` sharing its split-1 tensors (rayload.loading.reader.group):
the ranks, in spawned processes joined in a gloo group as a load's rank actors are,
fetch each split-1 tensor once between them, and scatter the columns. Checked against the
server's own byte count and the local load, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.plan import plan_shards
from rayload.loading.rank import load_rank
from support.group_ranks import group_bytes, load_group, split1_names

pytestmark = pytest.mark.slow  # spawns a process per rank


@pytest.mark.parametrize("batched", [False, True], ids=["one-load", "a-load-per-file"])
def test_a_tp_group_fetches_each_split1_tensor_once_and_holds_the_local_shards(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any, tmp_path: Path, batched: bool
) -> None:
    """TP=4 (without sharing, the rows of split-1 shards are fetched as runs: 1.88x at
    TP=4 in the bench). TP=2 through Ray: tests/ray_cluster/test_s3.py. ``batched``: each
    rank loads one file at a time, as vLLM's workers do (rayload.integrations.batches),
    the group agreeing on each file's split-1 tensors in turn."""
    tp = 4
    local, url = s3_checkpoints["index"]
    plan = plan_shards(open_checkpoint(local), tp)
    split1 = split1_names(plan.ranks[0])
    assert len(split1) >= 4  # o_proj and down_proj of each layer
    checkpoint = open_checkpoint(url)  # the driver's
    proxy.clear()
    results = load_group(checkpoint, tp, tmp_path, batched=batched)
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    files = len(checkpoint.files)
    assert [r["batches"] for r in results] == [files if batched else 1] * tp and files > 1
    for rank, result in enumerate(results):
        want, _ = load_rank(local, rank, tp, "scratch")
        assert result["tensors"].keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(result["tensors"][name], tensor), (rank, name)
        assert result["read"]["group.shared_tensors"] == len(split1)
    fetched = sum(r["bytes_read"] for r in results)
    assert proxy.served_bytes("models/index/") == fetched == group_bytes(plan)
    owned = [r["read"]["group.fetched_bytes"] for r in results]
    assert sum(owned) == sum(s.nbytes * tp for s in plan.ranks[0].shards if s.name in split1)
    # One load spreads the owners over every rank; a load per file spreads each file's
    # few split-1 tensors (two here) over the first ranks alone.
    assert all(owned) if not batched else sum(map(bool, owned)) >= 2
    print(
        f"one TP={tp} group sharing its split-1 tensors is served "
        f"{fetched / plan.checkpoint_bytes:.4f}x the checkpoint's tensor bytes "
        f"(whole tensors fetched for the group, by rank: {owned})"
    )


def test_a_rank_whose_fetch_fails_fails_the_group_naming_it(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any, tmp_path: Path
) -> None:
    """Rank 1 holds versions no object has: its GETs fail (412). It raises its own
    error, and rank 0, instead of waiting in a scatter, raises one naming rank 1 and the
    cause."""
    _, url = s3_checkpoints["index"]
    results = load_group(open_checkpoint(url), 2, tmp_path, changed_rank=1)
    kind, message = results[1]["error"]
    assert kind == "StorageError" and "changed" in message, message
    kind, message = results[0]["error"]
    assert kind == "StorageError", message
    assert message.startswith("rank 1 of the TP group could not fetch"), message
    assert "changed" in message and "models/index/" in message, message


def test_a_rank_failing_before_the_agreement_fails_the_group_at_once_naming_it(
    s3_checkpoints: dict[str, tuple[Path, str]], proxy: Any, tmp_path: Path
) -> None:
    """Rank 1 fails in rank.resolve (strict, a method it cannot have), before the group's
    agreement on the split-1 tensors: rank 0 raises one error naming rank 1 and its
    cause, well within the group's time-out, and fetches nothing."""
    import time

    from support.group_ranks import GROUP_TIMEOUT_S

    _, url = s3_checkpoints["index"]
    started = time.monotonic()
    results = load_group(open_checkpoint(url), 2, tmp_path, failing_rank=1)
    took = time.monotonic() - started
    kind, message = results[1]["error"]
    assert kind == "MethodUnavailableError", message
    kind, message = results[0]["error"]
    assert kind == "StorageError", message
    assert message.startswith("rank 1 of the TP group failed before the group agreed"), message
    assert "MethodUnavailableError" in message, message
    assert took < GROUP_TIMEOUT_S / 2, f"rank 0 waited {took:.0f} s: the group's time-out"
