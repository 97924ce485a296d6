"""The ``--policy`` option: a JSON file, inline JSON, or a codec shorthand such as ``zstd:3``.

Parsing errors and codecs that cannot run on this machine are reported before any data is read,
so a wrong option fails in a second, not after loading a 100 GB checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os

import nvcomp_checkpoint as nc
from nvcomp_checkpoint import boundedjson
from nvcomp_checkpoint.errors import CheckpointError, CodecUnavailableError
from nvcomp_checkpoint.version import install_hint

__all__ = ["parse_spec", "parse_policy", "check_policy_runs_here"]


def parse_spec(text: str) -> nc.CodecSpec:
    """``CODEC[:LEVEL][:FILTER]`` (see :meth:`~nvcomp_checkpoint.CodecSpec.parse`).

    Raises:
        CheckpointError: an unknown codec or filter, or a malformed level.
    """
    try:
        return nc.CodecSpec.parse(text)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc


def parse_policy(text: str | None) -> nc.CodecPolicy:
    """A :class:`~nvcomp_checkpoint.CodecPolicy` from the ``--policy`` argument.

    Args:
        text: A path to a JSON file, inline JSON (``CodecPolicy.to_dict()`` form; missing keys
            keep their defaults), a codec shorthand for every component, or ``None`` (defaults).

    Raises:
        CheckpointError: unreadable file, bad JSON, unknown keys, codecs or filters.
    """
    if text is None:
        return nc.CodecPolicy()
    stripped = text.strip()
    if stripped.startswith("{"):
        source, raw = "--policy (inline JSON)", stripped
    elif os.path.isfile(stripped) or stripped.endswith(".json"):
        source = f"--policy file {stripped}"
        try:
            with open(stripped, encoding="utf-8") as f:
                raw = f.read()
        except OSError as exc:
            raise CheckpointError(f"{source}: cannot read it ({exc.strerror or exc})") from exc
    else:
        return nc.CodecPolicy.uniform(parse_spec(stripped))
    try:
        data = boundedjson.loads(raw, source, "policy")
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{source}: not valid JSON ({exc})") from exc
    if isinstance(data, dict) and "recommended_policy" in data:
        data = data["recommended_policy"]  # the JSON `nvckpt bench --json` prints
    if not isinstance(data, dict):
        raise CheckpointError(f"{source}: expected a JSON object like CodecPolicy.to_dict()")
    data = dict(data)
    known = [f.name for f in dataclasses.fields(nc.CodecPolicy)]  # every field: a new one is known here too
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise CheckpointError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; policy keys are: {', '.join(known)}")
    try:
        return nc.CodecPolicy.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: {exc}") from exc


def _specs(policy: nc.CodecPolicy) -> list[nc.CodecSpec]:
    return [getattr(policy, c.value) for c in nc.Component] + list(policy.overrides.values())


def check_policy_runs_here(policy: nc.CodecPolicy) -> None:
    """Refuse, before any work, a policy that needs a GPU this machine does not have.

    Raises:
        CodecUnavailableError: a GPU-only codec or ``device='cuda'`` without CUDA and nvCOMP.
    """
    if nc.gpu_available():
        return
    gpu_only = sorted({s.codec for s in _specs(policy) if s.codec in nc.GPU_ONLY_CODECS})
    if gpu_only:
        raise CodecUnavailableError(
            f"codec {', '.join(map(repr, gpu_only))} runs only on a CUDA GPU with nvCOMP, and this machine has "
            "none usable; use a portable codec (--policy zstd), or run on a GPU machine with "
            f"the cu12 (or cu13) extra: {install_hint('cu12')}"
        )
    if policy.device.startswith("cuda"):
        raise CodecUnavailableError(
            f"policy device {policy.device!r} needs a CUDA GPU with nvCOMP, and this machine has none usable; "
            "use device 'auto' or 'cpu'"
        )
