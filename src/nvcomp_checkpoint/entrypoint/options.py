"""The options every integration takes and checks the same way: a codec policy, per-save options, ``incremental=True``."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..delta import ChainPolicy, chain_policy_of
from ..incremental import IncrementalFiles
from ..policy import CodecPolicy

__all__ = ["as_policy", "policy_and_metadata", "POLICY_OPTION_KEYS", "incremental_files"]

_POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(CodecPolicy))
#: Keys of a per-save options dict: a whole ``policy``, any :class:`CodecPolicy` field (``exp_avg``,
#: ``overrides`` ...) applied on top of it, and ``metadata`` stored in the file's index.
POLICY_OPTION_KEYS = ("policy", "metadata", *_POLICY_FIELDS)


def as_policy(policy: CodecPolicy | Mapping[str, Any] | str | None, where: str) -> CodecPolicy:
    """``policy`` as a :class:`CodecPolicy` (see :meth:`CodecPolicy.of`)."""
    return CodecPolicy.of(policy, where)


def policy_and_metadata(
    options: Any, default: CodecPolicy, label: str, name: str = "storage_options"
) -> tuple[CodecPolicy, dict[str, Any] | None]:
    """The policy and index metadata of one save, from a per-save options dict (keys: :data:`POLICY_OPTION_KEYS`).

    Raises:
        TypeError: ``options`` is not a dict, or a value has the wrong type.
        ValueError: ``options`` has keys outside :data:`POLICY_OPTION_KEYS`, or invalid values.
    """
    if options is None:
        return default, None
    if not isinstance(options, Mapping):
        raise TypeError(
            f"{label}: {name} must be a dict such as {{'policy': CodecPolicy(...)}} or {{'exp_avg': 'zstd'}}, "
            f"got {type(options).__name__}"
        )
    unknown = sorted(set(options) - set(POLICY_OPTION_KEYS), key=str)
    if unknown:
        raise ValueError(
            f"{label}: unknown {name} key(s) {unknown}; accepted: 'policy' (a CodecPolicy), "
            f"'metadata' (a JSON-safe dict) and the CodecPolicy fields {', '.join(_POLICY_FIELDS)}"
        )
    options = dict(options)
    given = options.pop("policy", None)
    metadata = options.pop("metadata", None)
    policy = default if given is None else as_policy(given, f"{label}: {name}['policy']")
    if options:
        policy = policy.with_overrides(**options)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"{label}: {name}['metadata'] must be a dict, got {type(metadata).__name__}")
    return policy, (dict(metadata) if metadata is not None else None)


def incremental_files(
    label: str,
    incremental: bool | ChainPolicy,
    full_every: int | None = None,
    delta_base: str | None = None,
    **options: Any,
) -> IncrementalFiles | None:
    """An integration's ``incremental=`` option (``None`` without it); checked before anything is set up.

    ``incremental`` is ``True`` (with ``full_every``, default 10, and ``delta_base``, default
    ``"previous"``) or a :class:`~nvcomp_checkpoint.ChainPolicy`, converted by
    :func:`~nvcomp_checkpoint.delta.chain_policy_of`, as the manager's is. ``options``: of :class:`IncrementalFiles`.

    With ``tiers=`` too, each delta is adopted with its base (:meth:`CheckpointSession.after_durable`):
    a tier gets a delta after its chain, and ``resume_path()`` lays a delta out with its chain.

    Raises:
        TypeError: ``incremental`` is neither a bool nor a ChainPolicy.
        ValueError: ``full_every`` or ``delta_base`` is invalid, or given with a ChainPolicy.
    """
    policy = chain_policy_of(incremental, full_every, delta_base, label)
    if policy is None:
        return None
    return IncrementalFiles(label, policy, **options)
