"""The error of a reload that failed says exactly which tensors each rank overwrote."""

from __future__ import annotations

from rayload.actors.launch import _reload_error
from rayload.actors.messages import RankError, RankOutcome
from rayload.actors.rank_group import RankFailure
from rayload.errors import RankFailedError


def _outcome(rank: int, overwritten: tuple[str, ...], failed: bool) -> RankOutcome:
    error = RankError.from_exception(OSError("disk gone")) if failed else None
    return RankOutcome(rank, "node", b"", 0, 1, error=error, overwritten=overwritten)


def test_reload_error_names_overwritten_tensors_per_rank() -> None:
    failure = RankFailure(rank=1, node_id="node", kind="raised", cause="OSError: disk gone")
    outcomes = {
        0: _outcome(0, ("a.weight", "b.weight", "c.weight"), False),
        1: _outcome(1, ("a.weight", "b.weight"), True),
    }
    error = _reload_error(failure, outcomes, 2, 60.0)
    assert isinstance(error, RankFailedError)
    assert "rank 1 overwrote 2 tensor(s): a.weight, b.weight" in str(error)
    assert "rank 0 overwrote 3 tensor(s)" in str(error)
    assert error.overwritten[1] == ("a.weight", "b.weight")  # type: ignore[attr-defined]


def test_reload_error_that_wrote_nothing_says_the_old_weights_stay() -> None:
    failure = RankFailure(rank=0, node_id="node", kind="raised", cause="OSError: disk gone")
    error = _reload_error(failure, {0: _outcome(0, (), True)}, 2, 60.0)
    assert "rank(s) [1] did not answer" in str(error)
    error = _reload_error(failure, {0: _outcome(0, (), True), 1: _outcome(1, (), False)}, 2, 60.0)
    assert "no tensor was overwritten" in str(error)
