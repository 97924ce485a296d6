"""JSON read from files with a bound on its nesting: a forged index or manifest nested a million deep
is refused as damaged (:class:`~nvcomp_checkpoint.errors.NestingLimitError`), never a ``RecursionError``."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from .errors import NestingLimitError

__all__ = ["MAX_JSON_DEPTH", "MAX_METADATA_DEPTH", "json_depth", "loads"]

#: Deepest nesting of arrays and objects accepted in JSON read from a file. Ours are at most a few
#: levels deep (an index with its metadata at most 1 + :data:`MAX_METADATA_DEPTH`); Python's
#: decoder recurses once per level, so an unbounded one ends in a RecursionError, or with a raised
#: recursion limit, a crash of the interpreter.
MAX_JSON_DEPTH = 100
#: Deepest nesting of a save's ``metadata=`` (refused at the save, before anything is written), so
#: that every index written stays within :data:`MAX_JSON_DEPTH` when read back.
MAX_METADATA_DEPTH = 64

# A JSON string (escapes included): brackets inside one do not nest.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE = ord('"')
_OTHER_BYTES = bytes(b for b in range(256) if b not in b'[]{}"')


def json_depth(data: bytes | str) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``data`` (0 for a scalar).

    Linear in the size and without recursion (the text is not parsed); of a text that is not
    JSON, a number that is never smaller than any parse would find.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if b"\\" in raw:  # escaped quotes: strings found by a regular expression and dropped first
        raw = _STRING.sub(b"", raw)
    # Only brackets and quotes matter (bytes.translate drops the rest at C speed); without escapes
    # left, each quote opens or closes a string.
    marks = np.frombuffer(raw.translate(None, _OTHER_BYTES), dtype=np.uint8)
    outside = (np.cumsum(marks == _QUOTE, dtype=np.int64) & 1) == 0
    steps = _STEP[marks] * outside
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def loads(data: bytes | str, where: str, what: str = "JSON", *, limit: int = MAX_JSON_DEPTH, **kwargs: Any) -> Any:
    """``json.loads(data, **kwargs)`` of JSON read from ``where``, refused when nested deeper than ``limit``.

    Raises:
        NestingLimitError: ``data`` is nested too deep (a ``FormatError`` and a ``ValueError``, naming
            ``where`` and ``what``).
        ValueError: ``data`` is not JSON (``json.JSONDecodeError``), or bytes that are not UTF-8 (``UnicodeDecodeError``).
    """
    if isinstance(data, (bytes, bytearray)):
        # As UTF-8, the only encoding written: json.loads would also take UTF-16/32 bytes, whose code
        # units may hold a quote or a bracket byte inside another character.
        data = bytes(data).decode("utf-8")
    # Counting the openings is a cheap first test: most documents have fewer than the limit in all.
    if data.count("[") + data.count("{") > limit and (depth := json_depth(data)) > limit:
        raise NestingLimitError(
            f"{where}: the {what} is nested {depth} levels deep, more than the {limit} this library reads "
            "(none it writes comes close): the file is damaged or was not written by nvcomp-checkpoint"
        )
    return json.loads(data, **kwargs)
