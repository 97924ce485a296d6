"""What every framework integration shares: its options, its sequence of saves and its tier copies.

Lightning's ``NvcompCheckpointIO``, Accelerate's ``NvcompStateHooks`` and the Trainer's
``NvcompTrainerCallback`` derive from :class:`SaveEntryPoint` and keep only what their framework needs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import IO, Any, Callable, Iterable, Mapping, TypeVar

import torch
import torch.distributed as dist

from .api import is_nvcomp_checkpoint, load
from .broadcast import load_broadcast
from .errors import CheckpointError, UnsafeCheckpointError
from .incremental import IncrementalFiles, unit_base_of
from .policy import CodecPolicy
from .report import SaveReport, merge_reports
from .savegroup import SavedCallback, SaveGroup, SaveSequence
from .tiers import Tier, TierCopies

__all__ = [
    "SaveEntryPoint", "as_policy", "policy_and_metadata", "POLICY_OPTION_KEYS", "torch_weights_only", "load_as_torch",
    "load_tree", "leader_load_applies", "checked_on_every_rank", "checkpoint_report",
    "report_metrics", "incremental_files",
]

_LOG = logging.getLogger("nvcomp_checkpoint")
_T = TypeVar("_T")

_POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(CodecPolicy))
#: Keys of a per-save options dict: a whole ``policy``, any :class:`CodecPolicy` field (``exp_avg``,
#: ``overrides`` ...) applied on top of it, and ``metadata`` stored in the file's index.
POLICY_OPTION_KEYS = ("policy", "metadata", *_POLICY_FIELDS)


def as_policy(policy: CodecPolicy | Mapping[str, Any] | str | None, where: str) -> CodecPolicy:
    """``policy`` as a :class:`CodecPolicy` (see :meth:`CodecPolicy.of`)."""
    return CodecPolicy.of(policy, where)


def policy_and_metadata(options: Any, default: CodecPolicy, label: str, name: str = "storage_options") -> tuple[CodecPolicy, dict[str, Any] | None]:
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


_TRUE = ("1", "y", "yes", "true")
_TORCH_WEIGHTS_ONLY_DEFAULT = torch.torch_version.TorchVersion(torch.__version__) >= "2.6"


def torch_weights_only(weights_only: bool | None) -> bool:
    """What ``torch.load(weights_only=weights_only)`` does: ``None`` is weights-only from torch 2.6 on;
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` are honoured as torch honours them."""
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        return True
    if weights_only is None:
        if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
            return False
        return _TORCH_WEIGHTS_ONLY_DEFAULT
    return bool(weights_only)


def load_as_torch(
    path: Any, map_location: Any, weights_only: bool | None, *, hint: str, storage_options: dict[str, Any] | None = None,
    leader_load: bool = False, plain_map_location: Any = None,
) -> Any:
    """:func:`load_tree` with ``torch.load``'s ``weights_only`` rules (:func:`torch_weights_only`),
    as a framework's loader passes them; a file a weights-only load refuses is named in an
    ``UnsafeCheckpointError`` that ends with ``hint`` (how to pass ``weights_only=False`` there)."""
    try:
        return load_tree(
            path, map_location, weights_only=torch_weights_only(weights_only), storage_options=storage_options,
            leader_load=leader_load, plain_map_location=plain_map_location,
        )
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{exc}{hint}") from exc


def load_tree(
    path: Any, map_location: Any = None, *, weights_only: bool = True, storage_options: dict[str, Any] | None = None,
    leader_load: bool = False, plain_map_location: Any = None,
) -> Any:
    """:func:`nvcomp_checkpoint.load`, or with ``leader_load`` where :func:`leader_load_applies`,
    :func:`nvcomp_checkpoint.load_broadcast`: a collective in which one rank per node reads ``path``
    and the node's other ranks receive the tree (on the CPU, unless ``map_location`` is a device).

    ``plain_map_location``: the ``map_location`` for a plain ``torch.save`` file when ``map_location``
    is ``None`` (a framework's own default for its plain files); the collective loads those on the CPU."""
    if leader_load and leader_load_applies():
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        return load_broadcast(path, device, weights_only=weights_only, storage_options=storage_options)
    if map_location is None and plain_map_location is not None and not is_nvcomp_checkpoint(path, storage_options=storage_options):
        map_location = plain_map_location
    return load(path, map_location, weights_only=weights_only, storage_options=storage_options)


def leader_load_applies() -> bool:
    """Whether a ``leader_load`` option makes a load collective: a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checked_on_every_rank(check: Callable[[], _T], where: str, leader_load: bool) -> _T:
    """Run this rank's ``check`` before a collective load, with an outcome every rank agrees on.

    A rank's own checks (a failed background save, a file missing on its node, the choice between a
    plain and a compressed file) can differ between ranks; a rank that raises while the others
    enter a ``leader_load`` collective would leave them waiting until the backend's timeout. With
    ``leader_load`` where :func:`leader_load_applies`, this is a collective (``all_gather_object``
    on the default group, gloo or NCCL) that every rank must call: if ``check`` raised on any rank,
    every rank raises (its own error, or a ``CheckpointError`` naming the failing rank and its
    message); if the ranks' results differ, every rank raises a ``CheckpointError`` naming them.
    Otherwise it is ``check()``.

    Returns:
        ``check()``'s result (picklable, compared with ``==`` across ranks).
    """
    if not (leader_load and leader_load_applies()):
        return check()
    error: Exception | None = None
    result: Any = None
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before the collective
        error = exc
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, ("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", result))
    if error is not None:
        raise error
    failed = [(rank, message) for rank, (kind, message) in enumerate(outcomes) if kind == "error"]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{where}: rank {rank} failed before the collective load (leader_load), so no rank loads: {message}")
    mine = dist.get_rank()
    differ = [rank for rank, (_, value) in enumerate(outcomes) if value != result]
    if differ:
        rank = differ[0]
        raise CheckpointError(
            f"{where}: the ranks see different checkpoint files before the collective load (leader_load): rank {mine} "
            f"found {result!r}, rank {rank} found {outcomes[rank][1]!r}. Give every rank the same files (a shared "
            "file system) or drop leader_load."
        )
    return result


def checkpoint_report(
    path: str | os.PathLike[str], seconds: float, *, reports: Iterable[SaveReport] = (),
    dcp_dirs: Iterable[str | os.PathLike[str]] = (), seconds_blocked: float | None = None,
) -> SaveReport | None:
    """The report of one committed checkpoint: ``reports`` in hand, merged with the report of each
    committed DCP directory in ``dcp_dirs`` (:func:`~nvcomp_checkpoint.dcp.dcp_report`: every rank
    file's index), as one save of ``seconds``.

    A report never fails a committed save, nor keeps a rank from the collective that follows: if
    one cannot be built (a rank file unreadable on a shared file system), a warning names the
    checkpoint and the cause, and the report covers ``reports`` alone (``None`` without them).
    """
    given = list(reports)
    parts = list(given)
    try:
        if dcp_dirs:
            from .dcp import dcp_report  # torch.distributed.checkpoint: only for the integrations that write DCP

            parts += [dcp_report(os.fspath(d)) for d in dcp_dirs]
        return merge_reports(os.fspath(path), parts, seconds, seconds_blocked) if parts else None
    except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; only its numbers are missing
        _LOG.warning(
            "%s: committed, but its save report could not be built (%s: %s); %s",
            os.fspath(path), type(exc).__name__, exc,
            "the report covers the other files only" if given else "no report for this save",
        )
        return merge_reports(os.fspath(path), given, seconds, seconds_blocked) if given else None


def incremental_files(label: str, incremental: bool, full_every: int | None, delta_base: str, **options: Any) -> IncrementalFiles | None:
    """An integration's ``incremental=True`` option (``None`` without it); checked before anything is set up.

    With ``tiers=`` too, each delta is adopted with its base (:meth:`SaveEntryPoint._after_durable`):
    a tier gets a delta after its chain, and ``resume_path()`` lays a delta out with its chain.

    Raises:
        ValueError: ``full_every`` or ``delta_base`` is invalid.
    """
    if not incremental:
        return None
    return IncrementalFiles(label, full_every, delta_base, **options)


def report_metrics(report: SaveReport, prefix: str = "nvckpt/") -> dict[str, float]:
    """The numbers of one save as flat metrics (for a framework's loggers).

    Returns:
        ``{prefix}ratio``, ``raw_bytes``, ``stored_bytes``, ``seconds`` (until durable),
        ``seconds_blocked`` (time the training loop waited), ``throughput_mb_s`` (raw MB per
        second of ``seconds``) and ``ratio/<component>`` for each component (``weights``,
        ``exp_avg`` ...).
    """
    blocked = report.seconds if report.seconds_blocked is None else report.seconds_blocked
    metrics = {
        f"{prefix}ratio": report.ratio,
        f"{prefix}raw_bytes": float(report.raw_bytes),
        f"{prefix}stored_bytes": float(report.stored_bytes),
        f"{prefix}seconds": report.seconds,
        f"{prefix}seconds_blocked": blocked,
        f"{prefix}throughput_mb_s": report.throughput_mb_s,
    }
    for name, stats in report.components.items():
        metrics[f"{prefix}ratio/{name}"] = stats.ratio
    # A save too fast for the clock has an infinite throughput, which loggers reject.
    return {k: float(v) for k, v in metrics.items() if v == v and abs(v) != float("inf")}


class SaveEntryPoint:
    """The options, saves and tier copies of one integration; the integration adds its framework's interface.

    Args (the same in every integration, documented here once):
        policy: Codec settings per component (a :class:`~nvcomp_checkpoint.CodecPolicy` or its dict
            form); the default is portable (zstd over byte planes), loadable without a GPU.
        workers: Compression threads per file (default: every core).
        async_save: Write in the background: the save returns once the state is copied (a
            snapshot, or the framework's own files on disk); the checkpoint appears only once complete
            and durable. A background failure is raised by the next save, load, :meth:`wait`, or the
            end of the run, whichever comes first, and only once.
        on_saved: Called with the :class:`~nvcomp_checkpoint.SaveReport` of each save once it is
            durable (with ``async_save``, on the background thread; it must not call :meth:`wait`).
        stream_wrapper: Wraps each compressed file's output stream (throttling, byte counting ...);
            its ``write`` must pass every byte on, in order.
        tiers: :class:`~nvcomp_checkpoint.Tier` s to copy each durable checkpoint to (a shared file
            system, an object store), each on its own schedule and with its own retention. Where the
            framework writes its checkpoints is tier 0, rotated by the framework; copies run in the
            background, named by the checkpoint's step, and :meth:`resume_path` is the newest that checks.
            With the integration's ``incremental=True``, a delta is copied after the part of its chain a
            tier lacks, and tier retention keeps the bases of the deltas it keeps.
        max_pending: With ``async_save``, saves that may be in flight at once; the next waits for a slot.

    Attributes:
        last_report: The :class:`~nvcomp_checkpoint.SaveReport` of the most recent durable save
            (``None`` before one); ``seconds_blocked`` is the time the save held training,
            ``seconds`` the time until it was durable. ``last_report.table()`` prints it.
        incremental: The integration's ``incremental=True`` bookkeeping (:func:`incremental_files`), or None.
    """

    incremental: IncrementalFiles | None = None

    def __init__(
        self,
        label: str,
        policy: CodecPolicy | Mapping[str, Any] | None = None,
        *,
        workers: int | None = None,
        async_save: bool = False,
        on_saved: SavedCallback | None = None,
        stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
        tiers: list[Tier] | None = None,
        max_pending: int = 1,
        log_as: str | None = None,
        tiers_hint: str | None = None,
    ) -> None:
        # Checked first: a wrong argument must not leave anything half set up.
        self.tiers: TierCopies | None = None if tiers is None else TierCopies(tiers, label)
        # Checks max_pending and on_saved; runs every on_saved callback and owns every background error.
        self._saves = SaveSequence(label, max_pending=max_pending, workers=workers, on_saved=on_saved, log_as=log_as)
        self.policy: CodecPolicy = as_policy(policy, f"{label}(policy=...)")
        self.workers = workers
        self.async_save = bool(async_save)
        self.max_pending = max_pending
        self.on_saved = on_saved
        self.stream_wrapper = stream_wrapper
        self._tiers_hint = tiers_hint or f"{label}(tiers=[nc.Tier(...)])"

    @property
    def last_report(self) -> SaveReport | None:
        return self._saves.last_report

    def pending(self) -> int:
        """Saves not yet durable (0 without ``async_save``)."""
        return self._saves.pending()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every pending save (and copy to ``tiers``) is durable; raise the first background failure.

        Raises:
            nvcomp_checkpoint.errors.CheckpointWriteError: A background save failed; what it would
                have replaced is untouched.
            TimeoutError: Still pending after ``timeout`` seconds.
        """
        self._wait_for_saves("wait()", timeout=timeout)
        if self.tiers is not None:
            self.tiers.wait()

    def resume_path(self, local_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The newest checkpoint copy on ``tiers`` that checks (every file), or ``None`` (a fresh start).

        Resumes on a fresh node, where tier 0 is gone; damaged or incomplete newer copies, and
        deltas whose chain is broken on a tier, are skipped (logged), falling back to the next
        tier, then to older steps. A copy on an object store, and a delta (``incremental=True``)
        with its chain, are downloaded or laid out, checked, into ``local_dir`` first (default
        ``.nvckpt-restore`` in the working directory).

        Raises:
            ValueError: No ``tiers`` were given.
        """
        if self.tiers is None:
            raise ValueError(f"{type(self).__name__}.resume_path(): no tiers; pass {self._tiers_hint}")
        return self.tiers.resume_path(local_dir)

    def close(self, when: str) -> None:
        """Wait for pending saves and copies, stop the background threads, raise a failure (``when`` reports it).

        While another exception is propagating, failures are logged instead, so the first error
        stays visible. A later save starts the threads again.
        """
        self._saves.close()
        propagating = sys.exc_info()[1] is not None
        if propagating:
            self._saves.log_errors()
        else:
            self._raise_errors(when)
        if self.tiers is not None:
            try:
                # The end of the run: the newest step reaches every tier whose schedule skipped it.
                self.tiers.wait(final=True)
            except Exception as exc:  # noqa: BLE001 - the first error stays visible
                if not propagating:
                    raise
                _LOG.error("a checkpoint copy to a tier failed: %s", exc)

    # -- for the integrations ---------------------------------------------------------------
    def _wait_for_saves(self, when: str, consequence: str = "", timeout: float | None = None) -> None:
        """Wait for the pending saves (not the tier copies) and raise a failure, naming ``when``."""
        self._saves.wait(timeout)
        self._raise_errors(when, consequence)

    def _raise_errors(self, when: str, consequence: str = "") -> None:
        self._saves.raise_errors(when, consequence)

    def _after_durable(self, step: int | None, path: str | os.PathLike[str], *more: SavedCallback) -> list[SavedCallback]:
        """What runs once a save of ``step`` at ``path`` is durable: ``more``, then the copy to the tiers."""
        if self.tiers is None or step is None:
            return list(more)
        tiers, incremental = self.tiers, self.incremental

        def adopt(report: SaveReport) -> None:
            # A delta is adopted with its base (read from the file): the tiers copy its chain first.
            base = None if incremental is None else unit_base_of(os.fspath(path), incremental.storage_options)
            tiers.adopt(step, path, base)

        return [*more, adopt]

    def _saved(self, report: SaveReport, after: list[SavedCallback]) -> None:
        """A synchronous save is durable: record it and run its callbacks."""
        self._saves.notify(report, after)

    def _save_group(
        self, path: Any, started: float, after: list[SavedCallback], hand_over: Callable[[SaveGroup], Any], *,
        background: bool = True, **fields: Any,
    ) -> SaveReport | None:
        """Begin a save of ``path`` as one group, let ``hand_over`` add its parts, then seal it.

        If ``hand_over`` raises, the parts already handed over finish and nothing is committed.
        ``background=False``: wait for the group and return its report (or raise its error).
        """
        group = self._saves.begin(path, started=started, notify=after, **fields)
        try:
            hand_over(group)
        except BaseException:
            self._saves.abandon(group)
            raise
        group.blocked = time.perf_counter() - started if background else 0.0
        self._saves.seal(group)  # completes now, or once the last background part is durable
        return None if background else self._saves.result(group)
