"""``python -m nvcomp_checkpoint.cli``: the same as the ``nvckpt`` console script."""

from __future__ import annotations

import sys

from .main import main

sys.exit(main())
