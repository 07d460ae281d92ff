"""The peer channel's wire without Ray: what a receiver says when gloo fails."""

from __future__ import annotations

import pytest

from rayload.actors.channel import _gloo_error

GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [192.0.2.2]:43656. This is typically caused by a remote worker crashing. Check "
    "the logs of the remote worker before reporting an error. GLHF! 🏖️"
)


@pytest.mark.parametrize(
    ("message", "said"),
    [
        (GLOO_CLOSED, "Connection closed by peer [192.0.2.2]:43656"),
        ("Connection reset by peer", "Connection reset by peer"),
        ("", "RuntimeError"),
    ],
)
def test_a_gloo_failure_is_said_without_its_source_line_and_advice(message: str, said: str) -> None:
    assert _gloo_error(RuntimeError(message)) == said
