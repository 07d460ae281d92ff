"""Writing a checkpoint directory (``rayload convert``, ``rayload make-checkpoint``): the
one translation of a failed write into an input error the user can act on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from rayload.errors import ConfigError


@contextmanager
def writing_to(out: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an :class:`OSError` raised inside the block (no such parent, not a directory,
    read-only filesystem, permission denied, disk full) into a :class:`ConfigError` naming
    the output ``out``: the output path is the user's choice, so a failed write is bad
    input, not a crash. Read errors belong outside the block (or translated before)."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(
            f"{os.fspath(out)}: cannot write ({reason}); choose a writable directory with "
            "free space"
        ) from exc
