"""Deadlines: the one way a ``timeout`` argument is checked, and turned into waits that threading accepts.

``None`` and ``float("inf")`` mean no limit; anything else must be a real number >= 0 (not a bool, not NaN).
"""

from __future__ import annotations

import math
import numbers
import threading
import time

__all__ = ["Deadline", "timeout_seconds", "MAX_WAIT_S"]

#: The longest single wait handed to threading (a longer one, 1e300 s, raises OverflowError there);
#: a wait in a loop simply waits again, and 292 years is no limit a caller can tell from none.
MAX_WAIT_S = float(threading.TIMEOUT_MAX)


def timeout_seconds(timeout: object, name: str = "timeout") -> float | None:
    """``timeout`` as seconds, ``None`` for no limit (``None`` or ``inf``).

    Raises:
        TypeError: Not a number (a string, a bool).
        ValueError: NaN or negative.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"{name} must be a number of seconds >= 0, or None (or float('inf')) for no limit; "
            f"got {type(timeout).__name__} {timeout!r:.40}"
        )
    seconds = float(timeout)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, or None (or float('inf')) for no limit; got {timeout!r}")
    return None if math.isinf(seconds) else seconds


class Deadline:
    """One point in time that several waits share.

    Args:
        timeout: Seconds from now (``None`` or ``inf``: no limit); checked by :func:`timeout_seconds`.
        name: The parameter, as the caller wrote it, named in the error (``"restore(timeout=...)"``).
    """

    def __init__(self, timeout: object, name: str = "timeout") -> None:
        #: The seconds given (``None``: no limit).
        self.seconds = timeout_seconds(timeout, name)
        self.end = None if self.seconds is None else time.monotonic() + self.seconds

    def left(self) -> float | None:
        """Seconds left, clamped to what one wait of threading or queue accepts (``None``: no limit)."""
        if self.end is None:
            return None
        return min(MAX_WAIT_S, max(0.0, self.end - time.monotonic()))

    @property
    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end

    def describe(self) -> str:
        """``"3 s"`` or ``"no limit"``, for messages."""
        return "no limit" if self.seconds is None else f"{self.seconds:g} s"
