"""Credentials in fsspec storage options: handed to fsspec as given, shown as ``***`` in every repr and str.

One place decides what a credential is (:func:`is_secret_key`); :class:`StorageOptions` and
:func:`redacted` apply it wherever options are kept or named in a message.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

__all__ = ["StorageOptions", "is_secret_key", "redacted", "REDACTED"]

#: What a credential's value is shown as.
REDACTED = "***"

# Fragments of option names that hold a credential, in fsspec's back ends and their clients: s3fs
# (key, secret, token, client_kwargs' aws_secret_access_key / aws_session_token, session),
# gcsfs (token: a path or a dict of credentials), adlfs (account_key, sas_token,
# connection_string, client_secret, credential), HTTP (headers' Authorization, auth, password).
# Broad on purpose: an endpoint shown as *** costs a look at the code; a key in a log costs a rotation.
_SECRET = re.compile(r"key|secret|token|passw|credential|auth|session|connection_string|private|cookie", re.IGNORECASE)


def is_secret_key(name: Any) -> bool:
    """Whether an option named ``name`` holds a credential (its value is never shown)."""
    return isinstance(name, str) and _SECRET.search(name) is not None


def redacted(value: Any) -> Any:
    """``value`` with the value of every credential (:func:`is_secret_key`) replaced by :data:`REDACTED`.

    Mappings (plain dicts in the result) and lists/tuples are followed to any depth; nothing else is
    changed. What error messages and reprs show in place of options that may hold credentials.
    """
    return _redacted(value, 0)


def _redacted(value: Any, depth: int) -> Any:
    if depth > 20:  # options are shallow; a deeper value is shown as a placeholder, never recursed into
        return "..."
    if isinstance(value, Mapping):
        return {k: REDACTED if is_secret_key(k) else _redacted(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_redacted(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


class StorageOptions(dict[str, Any]):
    """fsspec options that may hold credentials: a ``dict`` whose values reach fsspec and s3fs as given,
    while its ``repr``, ``str`` and f-string show each credential as ``***`` (see :func:`redacted`).

    Pickles with the real values (a spawned process must still authenticate). A plain ``dict`` made
    from it (``dict(opts)``, ``{**opts}``) is an ordinary dict again.
    """

    @classmethod
    def of(cls, options: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> StorageOptions | None:
        """``options`` as :class:`StorageOptions` (``None`` stays ``None``; one already is returned as is)."""
        if options is None or isinstance(options, StorageOptions):
            return options
        return cls(options)

    def __repr__(self) -> str:
        return repr(redacted(self))

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)
