"""``python -m rayload.cli``: the ``rayload`` command."""

import sys

from rayload.cli import main

sys.exit(main())
