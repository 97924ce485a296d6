"""The ``nvckpt`` command line (``nvcomp_checkpoint.cli.main:main``); see ``docs/cli.md``.

Each command group lives in its own module and uses only the public ``nvcomp_checkpoint`` API.
"""

from __future__ import annotations

__all__: list[str] = []
