"""The one check of a path read from a file or a store (a manifest, a pointer, an index, a base record).

Such a path is input: it may only name a place inside its own checkpoint's folder or prefix, on
the same store. Every reader, copier and command calls :func:`inside_path` before joining it.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import UnsafePathError

__all__ = ["inside_path", "MAX_NAME_BYTES"]

#: The longest file name any of our stores takes (ext4, XFS, APFS, NTFS: 255).
MAX_NAME_BYTES = 255
#: ``C:``, ``c:x``: a drive on Windows, where ``os.path.join`` would leave the folder for it.
_DRIVE = re.compile(r"^[A-Za-z]:")


def _why_not(entry: Any, *, single: bool, up: bool) -> str | None:
    """Why ``entry`` is not a relative path inside its folder (None: it is)."""
    if not isinstance(entry, str):
        return f"a {type(entry).__name__}, not a path"
    if not entry:
        return "empty"
    if "\x00" in entry:
        return "a NUL character"
    if "\\" in entry:
        return "a backslash (a separator on Windows)"
    if "://" in entry or "::" in entry:
        return "a URL: another store or host"
    if entry.startswith("/"):
        return "an absolute path"
    if _DRIVE.match(entry):
        return "a drive letter"
    parts = entry.split("/")
    if single and len(parts) > 1:
        return "a path with folders, not a plain name"
    for part in parts:
        if part in ("", "."):
            return "an empty or '.' component"
        if part == ".." and not up:
            return "a '..' component (out of the folder)"
        if len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            return f"a component over {MAX_NAME_BYTES} bytes"
    if up and all(p == ".." for p in parts):
        return "only '..' components (a folder, not a file)"
    return None


def inside_path(entry: Any, *, where: str, what: str, single: bool = False, up: bool = False) -> str:
    """``entry`` if it names a place inside its checkpoint's folder or prefix, else :class:`UnsafePathError`.

    Allowed: a ``/``-separated relative path whose components are neither empty, ``.`` nor ``..``,
    without NUL or backslash, scheme, drive or leading ``/``, each component at most
    :data:`MAX_NAME_BYTES` bytes.

    Args:
        entry: The path as the file records it (any JSON value).
        where: The file or store object it was read from (named in the error).
        what: What the entry is, as the message says it (``"names the file"``).
        single: Only a plain name (no ``/``): a file of one folder, a tag of a save folder.
        up: ``..`` components are allowed: a delta's base record, which is relative to the delta's
            folder and may name a sibling folder (``../checkpoint-3/model.nvc``) on the same store.

    Raises:
        UnsafePathError: ``entry`` would leave the folder, name another store, or is not a path.
    """
    why = _why_not(entry, single=single, up=up)
    if why is None:
        return entry
    shown = entry[:200] if isinstance(entry, str) else str(entry)[:100]
    raise UnsafePathError(
        f"{where}: {what} {shown!r}, which is not a path inside its checkpoint ({why}); nothing was read or written "
        "there: the file is forged or damaged, restore it from another copy"
    )
