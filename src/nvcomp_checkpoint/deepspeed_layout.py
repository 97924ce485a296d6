"""What a DeepSpeed checkpoint folder looks like, without importing DeepSpeed: file names, ``latest``,
the tag manifest, and the allow-list of the classes DeepSpeed pickles into its files.

Shared by the DeepSpeed integration (``attach``) and ``nvckpt`` (which may not import integrations), so
that both read a tag the same way and neither trusts a pickle.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from . import boundedjson
from .api import load
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DeepSpeedTagNotFoundError,
    FormatError,
    NestingLimitError,
    UnsupportedObjectError,
)
from .filedigest import file_record, record_problem, valid_record
from .filetype import HEAD_BYTES, NVCOMP, kind_of
from .policy import CodecPolicy, Component
from .safepaths import inside_path
from .storage import LOCAL
from .version import install_hint

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "CONVERTING_NAME",
    "LATEST_NAME",
    "LATEST_UNIVERSAL_NAME",
    "SAFE_GLOBAL_NAMES",
    "DEEPSPEED_PATTERNS",
    "MODEL_STATES",
    "OPTIM_PARTITION",
    "EXPERT",
    "OTHER_FILE",
    "TagFile",
    "classify_file",
    "is_tag_dir",
    "is_deepspeed_dir",
    "tag_dirs",
    "read_latest",
    "tag_to_load",
    "write_latest",
    "read_manifest",
    "write_manifest",
    "tag_file_records",
    "check_tag_complete",
    "check_tag_file",
    "tag_problems",
    "is_ours",
    "deepspeed_policy",
    "deepspeed_safe_globals",
    "safe_global_objects",
    "load_deepspeed_file",
    "is_universal_dir",
]

#: The tag's commit record, written once every rank's files are durable, before ``latest``.
MANIFEST_NAME = "nvckpt_manifest.json"
#: v2: each file's size and digest (:mod:`nvcomp_checkpoint.filedigest`) and the save's identity
#: (tag, world size, save id). v1 (sizes only) is still read, its files checked by size alone.
MANIFEST_FORMAT = "nvcomp-checkpoint deepspeed tag v2"
MANIFEST_FORMAT_V1 = "nvcomp-checkpoint deepspeed tag v1"
#: Present in a tag while ``nvckpt compress/decompress`` converts its files in place.
CONVERTING_NAME = "nvckpt_converting.json"
#: DeepSpeed's pointer to the newest tag: a file holding the tag's name.
LATEST_NAME = "latest"
#: The pointer DeepSpeed reads instead of ``latest`` when loading a universal checkpoint.
LATEST_UNIVERSAL_NAME = "latest_universal"

#: Every class DeepSpeed pickles into its checkpoint files (besides what ``torch.load(weights_only=True)``
#: allows anyway), by ``module.name``: the ZeRO and fp16 optimizers' loss scalers, the ZeRO stage, and
#: ZeRO 1/2's parameter slice map. Part of the format of a DeepSpeed tag: pinned by tests.
SAFE_GLOBAL_NAMES: tuple[str, ...] = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

#: DeepSpeed keeps the fp32 master weights as flat partitions whose names say nothing of weights
#: (``single_partition_of_fp32_groups/0``): without these globs they would be classified as "other"
#: and miss the byte-plane codec settings of weights. The moments (``.../state/0/exp_avg``) already
#: classify by their own names. ``*`` also matches ``/``, so each glob covers both the ZeRO files and
#: the model-states file, where ZeRO stage 0 keeps the optimizer (``optimizer/...``).
DEEPSPEED_PATTERNS: dict[str, str] = {
    "*/single_partition_of_fp32_groups/*": "weights",  # ZeRO 1/2, bf16 optimizer
    "*/fp32_flat_groups/*": "weights",  # ZeRO 3
    "*/fp32_groups_flat/*": "weights",  # fp16 fused optimizer (stage 0)
    "*/fp32_groups/*": "weights",  # fp16 unfused optimizer (stage 0)
}

MODEL_STATES = "model states"
OPTIM_PARTITION = "optim partition"
EXPERT = "expert"
OTHER_FILE = "other"

# DeepSpeed's file names (deepspeed/runtime/engine.py: _get_ckpt_name, _get_zero_ckpt_name,
# _get_expert_ckpt_name, _get_optimizer_ckpt_name; pipeline layers in pipe/module.py).
_NAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"mp_rank_(?P<mp>\d+)_model_states\.pt"), MODEL_STATES),
    (re.compile(r"zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt"), MODEL_STATES),
    (re.compile(r"(?:bf16_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt"), OPTIM_PARTITION),
    (re.compile(r"expp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt"), OPTIM_PARTITION),
    (re.compile(r"layer_(?P<layer>\d+)_expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt"), EXPERT),
    (re.compile(r"layer_(?P<layer>\d+)-model_(?P<mp>\d+)-model_states\.pt"), MODEL_STATES),
)


@dataclass(frozen=True)
class TagFile:
    """One file of a DeepSpeed tag, by its name.

    Attributes:
        name: The file name.
        kind: :data:`MODEL_STATES`, :data:`OPTIM_PARTITION`, :data:`EXPERT` or :data:`OTHER_FILE`.
        rank: The data-parallel (or expert-parallel) rank the file belongs to; None for a file of
            the whole model (``mp_rank_00_model_states.pt``, an expert file).
        mp_rank: The model-parallel rank, or None.
        expert: ``(layer, expert)`` of an expert file, else None.
    """

    name: str
    kind: str
    rank: int | None = None
    mp_rank: int | None = None
    expert: tuple[int, int] | None = None


def classify_file(name: str) -> TagFile:
    """The :class:`TagFile` of a file name of a DeepSpeed tag (:data:`OTHER_FILE` if DeepSpeed does not write it)."""
    for pattern, kind in _NAMES:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        groups = m.groupdict()
        rank = int(groups["rank"]) if groups.get("rank") is not None else None
        mp = int(groups["mp"]) if groups.get("mp") is not None else None
        expert = (int(groups["layer"]), int(groups["expert"])) if groups.get("expert") is not None else None
        return TagFile(name, kind, rank, mp, expert)
    return TagFile(name, OTHER_FILE)


def is_tag_dir(path: str | os.PathLike[str]) -> bool:
    """True when the local folder ``path`` holds files with DeepSpeed's names (a tag)."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any(classify_file(n).kind != OTHER_FILE for n in names)


def tag_dirs(path: str | os.PathLike[str]) -> list[str]:
    """The tags (sub-folder names, sorted) of a DeepSpeed checkpoint folder."""
    root = os.fspath(path)
    return sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)) and is_tag_dir(os.path.join(root, n)))


def is_deepspeed_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a DeepSpeed checkpoint folder (tags, usually ``latest``) or one tag of it."""
    return os.path.isdir(path) and (is_tag_dir(path) or bool(tag_dirs(path)))


def read_latest(save_dir: str | os.PathLike[str], name: str = LATEST_NAME) -> str | None:
    """The tag ``save_dir/latest`` (or the pointer ``name``) names, or None without one.

    Raises:
        UnsafePathError: The pointer is empty or names anything but a tag folder of ``save_dir``
            (``../other_run/g4``, an absolute path).
    """
    path = os.path.join(os.fspath(save_dir), name)
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except IsADirectoryError as exc:
        raise FormatError(
            f"{path}: is a directory, not the file naming the newest tag; remove it, or write the tag's name into a file there"
        ) from exc
    # Stripped as DeepSpeed strips it (engine.load_checkpoint), so both read the same tag.
    tag = raw.decode("utf-8", "replace").strip()
    return inside_path(tag, where=path, what="names the tag", single=True)


def tag_to_load(load_dir: str | os.PathLike[str], tag: Any = None) -> str | None:
    """The tag a load of ``load_dir`` reads: ``tag``, or without one the tag ``latest`` names
    (``None`` without ``latest``: DeepSpeed then loads nothing, and says so).

    Raises:
        DeepSpeedTagNotFoundError: That tag's folder is not in ``load_dir`` (named, with the tags that are
            there and the fix), where DeepSpeed itself would fail on a bare assertion.
        FormatError: ``latest`` is empty, a directory, or names a path outside ``load_dir``.
    """
    load_dir = os.fspath(load_dir)
    asked = tag is not None
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
    tag = str(tag)
    if not os.path.isdir(os.path.join(load_dir, tag)):
        there = tag_dirs(load_dir) if os.path.isdir(load_dir) else []
        fix = (
            f"the tags there are {', '.join(there)}: pass tag= to load one, or write its name into {LATEST_NAME}"
            if there
            else "it holds no tag: check the path, or copy the checkpoint there first"
        )
        named = f"tag={tag!r} is asked for" if asked else f"{os.path.join(load_dir, LATEST_NAME)} names tag {tag!r}"
        raise DeepSpeedTagNotFoundError(
            f"{load_dir}: {named}, but there is no folder {os.path.join(load_dir, tag)} "
            f"(removed, or the checkpoint copied without it); {fix}"
        )
    return tag


def write_latest(save_dir: str | os.PathLike[str], tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag``, atomically (a kill leaves the old or the new name, never a torn one)."""
    LOCAL.write_bytes(os.path.join(os.fspath(save_dir), LATEST_NAME), tag.encode())


def write_manifest(
    tag_dir: str | os.PathLike[str], tag: str, world_size: int, files: Mapping[str, Mapping[str, Any] | int]
) -> None:
    """Commit a tag: the manifest (every file of every rank with its size and digest, and the save's identity), atomically.

    Every file must be durable. ``files`` maps each file name to its :func:`~nvcomp_checkpoint.filedigest.file_record`
    (taken by the rank that wrote it: rank 0 may not see another node's files), or to its size alone,
    in which case the record is taken here from the file in ``tag_dir`` (which must have that size).

    Raises:
        CheckpointWriteError: A file given by size has another size now.
    """
    tag_dir = os.fspath(tag_dir)
    records = {}
    for name, given in files.items():
        if isinstance(given, int):
            record = file_record(os.path.join(tag_dir, name))
            if record["bytes"] != given:
                raise CheckpointWriteError(f"{os.path.join(tag_dir, name)}: {record['bytes']} bytes, not the {given} saved")
            given = record
        records[name] = dict(given)
    manifest = {
        "format": MANIFEST_FORMAT,
        "tag": tag,
        "world_size": world_size,
        "save_id": uuid.uuid4().hex,
        "files": records,
    }
    LOCAL.write_bytes(os.path.join(tag_dir, MANIFEST_NAME), json.dumps(manifest, indent=1, sort_keys=True).encode())


def tag_file_records(files: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The manifest records of the files this rank wrote (absolute path -> name in the tag): size and digest.

    An nvcomp-checkpoint file's digest is the index digest its writer put in the footer: one small
    read per file, no read-back of the file.
    """
    return {name: file_record(path) for path, name in files.items()}


def read_manifest(tag_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of ``tag_dir``, checked for form (not against the files), or None without one.

    A v1 manifest (sizes only) is returned with its sizes as records ``{"bytes": size}``.

    Raises:
        FormatError: The manifest is not one of this library's, or names a path outside the tag.
    """
    manifest_path = os.path.join(os.fspath(tag_dir), MANIFEST_NAME)
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read(1 << 24)
    except FileNotFoundError:
        return None
    except IsADirectoryError as exc:
        raise FormatError(f"{manifest_path}: is a directory, not a tag manifest; the tag cannot be trusted") from exc
    try:
        manifest = boundedjson.loads(raw, manifest_path, "tag manifest")
        files = manifest["files"]
        if manifest.get("format") not in (MANIFEST_FORMAT, MANIFEST_FORMAT_V1) or not isinstance(files, dict):
            raise ValueError("not a manifest of this library")
    except NestingLimitError:
        raise  # names the file and the depth already
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{manifest_path}: unreadable tag manifest ({type(exc).__name__}); the tag cannot be trusted") from exc
    v1 = manifest["format"] == MANIFEST_FORMAT_V1
    for name, record in files.items():
        inside_path(name, where=manifest_path, what="names the file", single=True)
        if v1:
            if not isinstance(record, int) or isinstance(record, bool) or record < 0:
                raise FormatError(f"{manifest_path}: gives {name!r} the size {record!r}, not a number of bytes")
            files[name] = {"bytes": record}
        elif not valid_record(record):
            raise FormatError(
                f"{manifest_path}: gives {name!r} the record {record!r}, not a size and a digest; the tag cannot be trusted"
            )
    return manifest


def tag_problems(tag_dir: str | os.PathLike[str], *, read_partition_count: bool = False) -> list[str]:
    """Everything that keeps ``tag_dir`` from being a complete tag, one message per problem (empty: complete).

    With a manifest: every file it names is there with its committed size and digest. Without one (a plain
    DeepSpeed tag): the ranks of each kind of per-rank file run from 0 without a gap, the model
    states are there, and none of the files is ours (ours without a manifest: a save that never committed).
    With ``read_partition_count``, the lowest rank's ZeRO file of a plain tag is read for the number
    of partitions DeepSpeed wrote (``partition_count``), so a missing last rank is found too.
    """
    tag_dir = os.fspath(tag_dir)
    if os.path.exists(os.path.join(tag_dir, CONVERTING_NAME)):
        return [_converting(tag_dir)]
    try:
        manifest = read_manifest(tag_dir)
    except FormatError as exc:
        return [str(exc)]
    names = sorted(n for n in os.listdir(tag_dir) if not n.startswith("."))
    problems = []
    if manifest is not None:
        return [str(exc) for exc in _manifest_problems(tag_dir, manifest)]
    files = [classify_file(n) for n in names]
    ours = [f.name for f in files if f.kind != OTHER_FILE and is_ours(os.path.join(tag_dir, f.name))]
    if ours:
        problems.append(_never_committed(os.path.join(tag_dir, ours[0])))
    if not any(f.kind == MODEL_STATES for f in files):
        problems.append(f"{tag_dir}: no model states file (mp_rank_00_model_states.pt or zero_pp_rank_*_model_states.pt)")
    by_kind: dict[tuple[str, str], list[int]] = {}
    for f in files:
        if f.rank is not None:
            prefix = f.name.split("zero_pp_rank_")[0] if "zero_pp_rank_" in f.name else "expp"
            by_kind.setdefault((f.kind, prefix), []).append(f.rank)
    for (kind, prefix), ranks in sorted(by_kind.items()):
        count = max(ranks) + 1
        if read_partition_count and kind == OPTIM_PARTITION and prefix != "expp":
            path = os.path.join(tag_dir, f"{prefix}zero_pp_rank_{min(ranks)}_mp_rank_00_optim_states.pt")
            written = _partition_count(path)
            if written > MAX_PARTITIONS:
                problems.append(
                    f"{path}: says partition_count {written}, over {MAX_PARTITIONS} ranks; the file is damaged or forged: "
                    "restore the tag from another copy"
                )
                continue
            count = max(count, written)
        missing = sorted(set(range(count)) - set(ranks))
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (f", ... ({len(missing)} in all)" if len(missing) > 20 else "")
            problems.append(f"{tag_dir}: the {kind} files of ranks [{shown}] are missing (ranks up to {max(ranks)} are there)")
    return problems


#: The most ZeRO partitions (data-parallel ranks) a DeepSpeed file may say were written: the count
#: read from a file builds the set of ranks to look for, so it is bounded before use.
MAX_PARTITIONS = 1 << 20


def _partition_count(path: str) -> int:
    """The number of ZeRO partitions a DeepSpeed optimizer file says were written (0 when it does not say)."""
    if not os.path.exists(path):
        return 0
    try:
        state = load_deepspeed_file(path, map_location="cpu")
    except CheckpointError:
        return 0  # the file's own check reports it
    count = state.get("optimizer_state_dict", {}).get("partition_count") if isinstance(state, dict) else None
    counts = count if isinstance(count, (list, tuple)) else [count]
    return max((c for c in counts if isinstance(c, int) and not isinstance(c, bool)), default=0)


def check_tag_complete(tag_dir: str | os.PathLike[str]) -> bool:
    """Raise unless every file the manifest of ``tag_dir`` names is there with its committed size.

    Sizes only, so that each rank's load reads nothing of the other ranks' files; :func:`check_tag_file`
    checks the digest of the file a rank loads, :func:`tag_problems` those of every file.

    Returns:
        True if the tag has a manifest (and is complete), False if it has none (a plain DeepSpeed tag,
        or one of ours whose save never committed).

    Raises:
        CheckpointNotFoundError: A file the manifest names is missing.
        FormatError: The manifest is unreadable, a size differs, or the tag is being converted in place.
    """
    tag_dir = os.fspath(tag_dir)
    if os.path.exists(os.path.join(tag_dir, CONVERTING_NAME)):
        raise FormatError(_converting(tag_dir))
    manifest = read_manifest(tag_dir)
    if manifest is None:
        return False
    for problem in _manifest_problems(tag_dir, manifest, digests=False):
        raise problem
    return True


def _manifest_problems(tag_dir: str, manifest: dict[str, Any], *, digests: bool = True) -> list[FormatError]:
    """Each file the manifest names that is missing (:class:`CheckpointNotFoundError`), of another size, or
    (with ``digests``) another save's (its digest differs: :class:`MixedSaveError`), each named."""
    problems: list[FormatError] = []
    for name in sorted(manifest["files"]):
        problem = _file_problem(tag_dir, name, manifest, digests=digests)
        if problem is not None:
            problems.append(problem)
    return problems


def _file_problem(tag_dir: str, name: str, manifest: dict[str, Any], *, digests: bool = True) -> FormatError | None:
    path = os.path.join(tag_dir, name)
    if not os.path.exists(path):
        return CheckpointNotFoundError(
            f"{path}: missing from committed tag {manifest.get('tag')!r} (its manifest names it); restore the file or load another tag"
        )
    record = manifest["files"][name]
    if not digests or ("index_xxh3" not in record and "blake2b" not in record):  # a v1 manifest: sizes only
        actual = os.path.getsize(path)
        if actual == record["bytes"]:
            return None
        return FormatError(
            f"{path}: {actual} bytes, but tag {manifest.get('tag')!r} committed {record['bytes']}; the file was changed or truncated"
        )
    return record_problem(path, record, f"tag {manifest.get('tag')!r}")


def check_tag_file(path: str | os.PathLike[str]) -> bool:
    """Raise unless the file at ``path`` is the one its tag's manifest committed (size and digest).

    Returns:
        True if the tag has a manifest naming the file, False otherwise (a plain DeepSpeed tag, or a file the manifest does not name).

    Raises:
        MixedSaveError: The file is another save's (its digest differs: another run's or tag's file copied in).
        FormatError: The manifest is unreadable, or the file's size differs.
    """
    tag_dir, name = os.path.split(os.fspath(path))
    manifest = read_manifest(tag_dir)
    if manifest is None or name not in manifest["files"]:
        return False
    problem = _file_problem(tag_dir, name, manifest)
    if problem is not None:
        raise problem
    return True


def _converting(tag_dir: str) -> str:
    return (
        f"{tag_dir}: `nvckpt compress/decompress` was converting this tag in place and did not finish; "
        "run the same command again to finish it"
    )


def _never_committed(path: str) -> str:
    tag = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return (
        f"{path}: its tag {tag!r} was never committed (no {MANIFEST_NAME}: a save was interrupted); "
        "load the tag `latest` names, or another"
    )


def is_ours(path: str | os.PathLike[str]) -> bool:
    """Whether the file at ``path`` is an nvcomp-checkpoint file (False when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
        return kind_of(head, os.path.getsize(path)) == NVCOMP
    except OSError:
        return False  # the load names the missing or unreadable file


def deepspeed_policy(policy: CodecPolicy | Mapping[str, Any] | str | None = None, where: str = "policy") -> CodecPolicy:
    """``policy`` (any form :meth:`CodecPolicy.of` takes) with :data:`DEEPSPEED_PATTERNS` under the user's own patterns."""
    base = CodecPolicy.of(policy, where)
    return base.with_overrides(patterns={**DEEPSPEED_PATTERNS, **{k: Component(v).value for k, v in base.patterns.items()}})


# -- the allow-list ------------------------------------------------------------------------------


class _StandIn:
    """What a DeepSpeed object is read as where DeepSpeed is not installed: its state, nothing of its code.

    ``nvckpt inspect`` and ``verify`` read such files; writing one back (compress, decompress) needs
    the real class, so pickling a stand-in fails naming what to install.
    """

    _name = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self._name} (DeepSpeed not installed)>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UnsupportedObjectError(
            f"a {self._name} read from a DeepSpeed checkpoint cannot be written back without DeepSpeed: "
            f"pip install deepspeed (or the deepspeed extra: {install_hint('deepspeed')})"
        )


def _resolve(name: str) -> Any:
    """The object ``name`` (one of :data:`SAFE_GLOBAL_NAMES`) stands for.

    Only the modules of the allow-list are imported here, never one a file names; without DeepSpeed a
    stand-in is registered under the name instead (``(object, name)``, torch's form for that).
    """
    if name not in SAFE_GLOBAL_NAMES:  # pragma: no cover - callers pass only the allow-list
        raise ValueError(f"{name}: not in the DeepSpeed allow-list")
    module_name, _, attr = name.rpartition(".")
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
    obj = getattr(module, attr, None) if module is not None else None
    if obj is not None and f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}" == name:
        return obj
    stand_in = type(attr, (_StandIn,), {"_name": name, "__module__": __name__})
    return (stand_in, name)


_ALLOW_LOCK = threading.Lock()
_ALLOW_USERS = 0
_ALLOW_ADDED: list[Any] = []
_RESOLVED: list[Any] = []


def safe_global_objects() -> list[Any]:
    """The allow-list as torch's ``add_safe_globals`` takes it: DeepSpeed's classes, or ``(stand-in, name)`` pairs."""
    with _ALLOW_LOCK:
        if not _RESOLVED:
            _RESOLVED.extend(_resolve(name) for name in SAFE_GLOBAL_NAMES)
        return list(_RESOLVED)


@contextlib.contextmanager
def deepspeed_safe_globals() -> Iterator[None]:
    """Allow :data:`SAFE_GLOBAL_NAMES` in weights-only loads while the block runs.

    torch's ``safe_globals`` context manager edits one process-wide set, so its exit in one thread
    would withdraw the classes from a load running in another: the classes are added by the first
    user and withdrawn by the last, and a class the process had allowed already is left alone.
    """
    global _ALLOW_USERS
    objects = safe_global_objects()
    with _ALLOW_LOCK:
        if _ALLOW_USERS == 0:
            present = set(map(id, torch.serialization.get_safe_globals()))
            _ALLOW_ADDED[:] = [g for g in objects if id(g) not in present]
            torch.serialization.add_safe_globals(list(_ALLOW_ADDED))
        _ALLOW_USERS += 1
    try:
        yield
    finally:
        with _ALLOW_LOCK:
            _ALLOW_USERS -= 1
            if _ALLOW_USERS == 0 and _ALLOW_ADDED:
                from torch._weights_only_unpickler import _remove_safe_globals  # noqa: PLC0415 - torch has no public remove

                _remove_safe_globals(list(_ALLOW_ADDED))
                _ALLOW_ADDED.clear()


#: The folder of per-parameter files in a universal checkpoint (DeepSpeed's ``ds_to_universal`` output).
UNIVERSAL_PARAMS_DIR = "zero"


def is_universal_dir(tag_dir: str | os.PathLike[str]) -> bool:
    """Whether ``tag_dir`` is a universal checkpoint: ``ds_to_universal`` copies the model-states files of a
    (committed) tag there as they are, ours included, next to its ``zero/`` folder, and writes no manifest."""
    return os.path.isdir(os.path.join(tag_dir, UNIVERSAL_PARAMS_DIR))


def load_deepspeed_file(path: str | os.PathLike[str], map_location: Any = None) -> Any:
    """Load one file of a DeepSpeed checkpoint, ours or plain ``torch.save``, without trusting its pickle.

    A file in a tag directory that has a manifest is loaded only if every file the manifest names
    is there with its committed size, and the file itself has the digest the manifest records.

    Raises:
        CheckpointNotFoundError: ``path``, or another file of its committed tag, is missing.
        FormatError: A file of the tag differs in size from the one committed, or the tag was never committed
            (one of our files in a folder without a manifest that is not a universal checkpoint).
        MixedSaveError: The file is not the one its tag committed (another run's or tag's file copied in).
        UnsafeCheckpointError: The file holds a class outside :data:`SAFE_GLOBAL_NAMES` (named).
    """
    tag_dir = os.path.dirname(os.fspath(path))
    if not check_tag_complete(tag_dir) and is_ours(path) and not is_universal_dir(tag_dir):
        # Our files without a manifest: a save that died before every rank's files were durable.
        raise FormatError(_never_committed(os.fspath(path)))
    check_tag_file(path)
    with deepspeed_safe_globals():
        return load(path, map_location=map_location, weights_only=True)
