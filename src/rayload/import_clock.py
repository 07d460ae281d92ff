"""When this process began importing rayload, and when it had imported torch.

``rayload/__init__.py`` imports this module first, so :data:`IMPORT_START_NS` is the
moment ``import rayload`` began, and torch (rayload's heaviest dependency, imported by
``rayload.loading``) is imported here, timed on its own. A rank actor's
``rayload.spawn.import.*`` spans start from these (see
``rayload.actors.rank_actor.IMPORT_TIMES``).
"""

from __future__ import annotations

import time

IMPORT_START_NS = time.time_ns()

import torch  # noqa: E402, F401  (timed: imported here, between the two stamps)

TORCH_IMPORTED_NS = time.time_ns()
