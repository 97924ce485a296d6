"""The public entry points: ``save``, ``load`` and ``open``."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Mapping

import torch

from .delta import BaseSource
from .errors import CheckpointError, FormatError, SizeLimitError, UnsafeCheckpointError
from .filetype import (
    ACCELERATE_DIR,
    DCP_DIR,
    HEAD_BYTES,
    HF_TRAINER_DIR,
    LIGHTNING_SHARDED_DIR,
    NVCOMP,
    SAFETENSORS,
    TORCH,
    ZIP_HEAD,
    kind_of,
    path_contents,
)
from .format.layout import FOOTER_MAGIC, MAGIC, magic_offset
from .format.skeleton import weights_only_detail
from .format.torchsave import check_torch_archive
from .pending import wait_for_path
from .policy import CodecPolicy
from .progressbar import progress_bar, tensor_bytes
from .reader import CheckpointReader, MapLocation
from .report import SaveReport, format_bytes
from .saveoptions import SaveOptions
from .storage import open_checkpoint_stream, storage_for, write_errors
from .writer import CheckpointWriter, TreePlan

__all__ = [
    "save",
    "load",
    "open",
    "verify",
    "is_nvcomp_checkpoint",
    "VerifyResult",
    "VerifyProblem",
    "write_checkpoint",
    "save_with_options",
    "log_report",
]

_LOG = logging.getLogger("nvcomp_checkpoint")


def save(
    obj: Any,
    path: str | os.PathLike[str],
    policy: CodecPolicy | Mapping[str, Any] | str | None = None,
    *,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    progress: Callable[[int], None] | bool | None = None,
    stream_wrapper: Callable[[IO[bytes]], IO[bytes]] | None = None,
    base: str | os.PathLike[str] | None = None,
    base_state: Any = None,
    file_mode: int | None = None,
) -> SaveReport:
    """Save a checkpoint tree (state dicts, optimizer state, Lightning checkpoints ...).

    The file appears at ``path`` only once it is complete and durable: a failed or killed save
    leaves whatever was there before untouched.

    Args:
        obj: Any tree of dicts, lists and tuples holding tensors and plain values.
        path: Local path, or an fsspec URL such as ``s3://bucket/ckpt.nvc``.
        policy: Codec settings per component: a :class:`CodecPolicy`, a dict of its fields, or a
            codec shorthand for every component (``"zstd:3"``); defaults to :class:`CodecPolicy()`.
        metadata: JSON-safe values stored in the index (read back with ``open(path).metadata``).
        storage_options: Passed to fsspec for URLs (credentials, endpoint ...).
        workers: Compression threads (default: every core).
        progress: Called with the raw bytes of each frame once it is written (in the calling
            thread), or ``True``: a progress bar on stderr (bytes, speed, time left) while the save
            runs, when stderr is a terminal.
        stream_wrapper: Wraps the output stream (benchmarks throttle storage with it); the
            wrapper's ``write`` must pass every byte on, in order (it is called from the writer's
            own thread for the frames, one call at a time).
        base: An earlier checkpoint of the same run: the file is written as a delta of it
            (docs/format.md, "Delta files"). Each tensor whose key, dtype and shape match one of
            the base is stored, byte plane by byte plane, plain, XORed with the base's or as the
            integer difference from it, whichever is smallest. Loading the delta needs the base
            at the same relative path, on the same store (a base in another bucket, on another
            host or drive is refused: a reader never follows a base record off the delta's store).
        base_state: With ``base``: the state that was saved to ``base``, kept by the caller, so
            that the base's values need not be decoded (about 2x faster). Keep a copy
            (``copy.deepcopy(state)`` when the base is saved): ``state_dict()`` tensors are the
            live ones, which training changes. A wrong copy cannot be caught here (the base's
            index holds checksums of its compressed frames, not of its values): the reader checks
            each value the delta uses against a digest, so it fails loudly on load, and that
            delta cannot be read. When in doubt, omit it.
        file_mode: Permission bits of a new local file, such as ``0o600`` (default: ``0o666`` less the
            umask, as ``open`` gives); ``nvckpt compress`` passes the source file's. Object stores have none.

    Returns:
        A :class:`SaveReport` with raw and stored bytes, time and a per-component table.
    """
    with contextlib.ExitStack() as bar:
        if progress is True:
            progress = bar.enter_context(progress_bar(f"saving {os.path.basename(os.fspath(path))}", tensor_bytes(obj)))
        options = SaveOptions.of(
            path,
            "save",
            policy=policy,
            metadata=metadata,
            storage_options=storage_options,
            workers=workers,
            progress=progress or None,
            stream_wrapper=stream_wrapper,
            base=base,
            base_state=base_state,
            file_mode=file_mode,
        )
        report = save_with_options(obj, path, options)
    log_report(report)
    return report


def save_with_options(obj: Any, path: str | os.PathLike[str], options: SaveOptions) -> SaveReport:
    """:func:`save` with its options already built (:meth:`SaveOptions.of`): what entry points below the public API call.

    Logs nothing: an entry point logs one line per checkpoint, once it is committed
    (:meth:`~nvcomp_checkpoint.savegroup.SaveSequence.notify`), not one per file.
    """
    wait_for_path(path)
    return write_checkpoint(obj, path, options=options)


def write_checkpoint(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    options: SaveOptions,
    pre_encoded: dict[int, Any] | None = None,
    plan: TreePlan | None = None,
    depth: int = 2,
) -> SaveReport:
    """:func:`save` without waiting for async saves or logging (the async saver's worker runs this).

    Args:
        options: Everything the caller asked of this save, built once by :meth:`SaveOptions.of`.
        pre_encoded: Frames an async snapshot compressed on the GPU already, by tensor number.
        plan: ``obj`` already flattened and planned (an async snapshot's), not done again.
        depth: Chunks in flight per compression worker (:class:`CheckpointWriter`).
    """
    where = os.fspath(path)
    storage, spath = storage_for(path, options.storage_options)
    start = time.perf_counter()
    # Temporary files of saves killed in this directory (where their writers can be told dead).
    storage.remove_stale_temp_files(os.path.dirname(spath))
    base = options.base
    if base is not None:
        wait_for_path(base)
    source = (
        BaseSource.open(base, where, CheckpointReader, base_state=options.base_state, storage_options=options.storage_options)
        if base is not None
        else None
    )
    try:
        with write_errors(where):
            with storage.open_write(spath, mode=options.file_mode) as stream:
                if options.stream_wrapper is not None:
                    stream = options.stream_wrapper(stream)
                writer = CheckpointWriter(
                    stream,
                    options.policy,
                    where,
                    workers=options.workers,
                    progress=options.progress,
                    pre_encoded=pre_encoded,
                    base=source,
                    depth=depth,
                )
                _, stats, raw = writer.write(obj, options.metadata, plan=plan)
                stored = writer.bytes_written
    finally:
        if source is not None:
            source.close()
    seconds = time.perf_counter() - start
    return SaveReport(where, raw, stored, seconds, stats, seconds, base=base)


def log_report(report: SaveReport, what: str = "saved") -> None:
    """One INFO line per save on logger ``nvcomp_checkpoint``; the full report rides in ``extra``.

    The one place a save is logged, whichever entry point made it: ``save``, ``save_async``, and
    the commit of every integration's and the manager's checkpoints (``SaveSequence.notify``).
    The line: what, path, raw -> stored MB, ratio, seconds until durable, seconds the caller was
    blocked, throughput and the ratio per component.
    """
    if not _LOG.isEnabledFor(logging.INFO):
        return
    blocked = report.seconds if report.seconds_blocked is None else report.seconds_blocked
    parts = ", ".join(f"{name} {stats.ratio:.3f}x" for name, stats in report.components.items())
    _LOG.info(
        "%s %s: %s -> %s (%.3fx) in %.2f s, blocked %.3f s, %.0f MB/s [%s]",
        what,
        report.path,
        format_bytes(report.raw_bytes),
        format_bytes(report.stored_bytes),
        report.ratio,
        report.seconds,
        blocked,
        report.throughput_mb_s,
        parts,
        extra={"nvckpt_report": report.to_dict()},
    )


def is_nvcomp_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """True if ``path`` is a file that starts with this format's guard and magic, or its magic (files written
    before the guard), once pending async saves to it land.

    A failed async save to ``path`` is not raised here (the file there is the previous one); it
    stays for ``wait_for_saves``, the saver, or the next save to report.
    """
    wait_for_path(path, raise_errors=False)
    storage, spath = storage_for(path, storage_options)
    try:
        with storage.open_read(spath) as f:
            return magic_offset(f.read(HEAD_BYTES)) is not None
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False


def load(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    *,
    weights_only: bool = True,
    storage_options: dict[str, Any] | None = None,
    max_bytes: int | None = None,
) -> Any:
    """Load a checkpoint saved by :func:`save`, or a plain ``torch.save`` file.

    Args:
        path: Local path or fsspec URL.
        map_location: As for ``torch.load``: ``None`` (the saved device; the CPU where that is
            a GPU and there is none), a device, a ``{saved: target}`` dict, or a callable.
            On a CUDA device, tensors are decompressed on that device.
        weights_only: Refuse to construct arbitrary Python objects (the rules of
            ``torch.load(weights_only=True)``). Pass ``False`` only for files you trust.
        storage_options: Passed to fsspec for URLs.
        max_bytes: For files from untrusted sources: a :class:`SizeLimitError` instead of
            decoding more than this many bytes (object tree plus tensors; for a plain
            ``torch.save`` file, its size, and what its pickle builds: its storages and
            copies, or the bytes its tensors span if more), checked before anything is allocated.

    Returns:
        The saved tree with bit-identical tensors.
    """
    wait_for_path(path)
    where = os.fspath(path)
    storage, spath = storage_for(path, storage_options)
    try:
        with open_checkpoint_stream(storage, spath, where) as f:
            head = f.read(HEAD_BYTES)
    except FormatError as exc:
        directory = _directory_error(where, storage, spath)
        if directory is not None:
            raise directory from exc
        raise
    if kind_of(head, storage.size(spath)) == NVCOMP:
        with CheckpointReader(path, storage_options=storage_options, max_bytes=max_bytes) as reader:
            return reader.load(map_location, weights_only=weights_only)
    _check_plain_head(where, storage, spath, head)
    if max_bytes is not None and storage.size(spath) > max_bytes:
        raise SizeLimitError(f"{where}: a torch.save file of {storage.size(spath)} bytes, over max_bytes={max_bytes}")
    return _load_plain(where, storage, spath, map_location, weights_only, max_bytes)


def _check_plain_head(where: str, storage: Any, spath: str, head: bytes) -> None:
    """Refuse, with the right reason, a file that is neither format before unpickling it."""
    size = storage.size(spath)
    kind = kind_of(head, size)
    if kind == SAFETENSORS:
        raise FormatError(
            f"{where}: a safetensors file, not a checkpoint of this library or of torch.save; read it with "
            "safetensors.torch.load_file(), or compress it with `nvckpt compress`"
        )
    if not head:
        raise FormatError(f"{where}: the file is empty (an interrupted copy or save?)")
    if MAGIC.startswith(head):
        raise FormatError(f"{where}: {len(head)} bytes is too small to be a checkpoint (truncated?)")
    if size >= len(FOOTER_MAGIC):
        # Also for what looks like a torch.save file: a damaged guard (docs/format.md) starts
        # like a pickle, and unpickling it would only repeat its hint.
        with storage.open_read(spath) as f:
            f.seek(size - len(FOOTER_MAGIC))
            if f.read(len(FOOTER_MAGIC)) == FOOTER_MAGIC:
                raise FormatError(f"{where}: an nvcomp-checkpoint file whose header is damaged; restore it from another copy")
    if kind == TORCH:
        return
    raise FormatError(
        f"{where}: not a checkpoint: neither an nvcomp-checkpoint file nor a torch.save file (it starts with {head[:8]!r})"
    )


def _load_plain(
    where: str, storage: Any, spath: str, map_location: MapLocation, weights_only: bool, max_bytes: int | None = None
) -> Any:
    """A file written by ``torch.save`` (a run that switched to this library resumes from it)."""
    import pickle

    try:
        with storage.open_read(spath) as f:
            if weights_only and f.read(len(ZIP_HEAD)) == ZIP_HEAD:
                # What the weights-only unpickler would build but the process cannot survive
                # (a dict key of tuples 100,000 deep), state set on an enum member, and more
                # bytes than max_bytes are refused first, as for our own files.
                check_torch_archive(f, storage.size(spath), where, max_bytes)
            f.seek(0)
            if map_location is None and not torch.cuda.is_available():
                # As for our own files: a checkpoint saved on a GPU still loads where there is none.
                map_location = "cpu"
            # torch.load takes a dict, not any Mapping.
            location = dict(map_location) if isinstance(map_location, Mapping) else map_location
            return torch.load(f, map_location=location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        # torch's weights-only unpickler also says "Weights only load failed" for bytes that
        # are no pickle at all ("Unsupported operand"): that is damage, not an unsafe object.
        if "Weights only load failed" in text and "Unsupported operand" not in text:
            detail = _first_line(exc)
            raise UnsafeCheckpointError(
                f"{where}: this plain torch.save file holds Python objects that a weights-only load refuses"
                + (f" ({detail})" if detail else "")
                + ". If you trust the file, load it with weights_only=False, or allow the type with "
                "torch.serialization.add_safe_globals([...])."
            ) from exc
        raise FormatError(
            f"{where}: neither an nvcomp-checkpoint file nor a readable torch.save file ({_first_line(exc)})"
        ) from exc
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types on damaged files
        raise FormatError(
            f"{where}: neither an nvcomp-checkpoint file nor a readable torch.save file "
            f"({type(exc).__name__}: {_first_line(exc)})"
        ) from exc


def _first_line(exc: BaseException) -> str:
    # torch's load errors run to a page of advice; keep the line that names the problem.
    return weights_only_detail(exc)


def open(  # noqa: A001
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None, max_bytes: int | None = None
) -> CheckpointReader:
    """Open a checkpoint for lazy reading of single tensors or components.

    ``max_bytes`` bounds what one ``load``/``read``/``keys`` call may decode (see :func:`load`).

    Example:
        >>> with nvcomp_checkpoint.open("ckpt.nvc") as reader:
        ...     reader.keys(); reader.read("model/weight"); reader.summary()
    """
    wait_for_path(path)
    try:
        return CheckpointReader(path, storage_options=storage_options, max_bytes=max_bytes)
    except FormatError as exc:
        directory = _directory_error(os.fspath(path), *storage_for(path, storage_options))
        if directory is not None:
            raise directory from exc
        raise


def _directory_loaders(where: str) -> dict[str, str]:
    """For each kind of checkpoint directory (:func:`filetype.directory_kind`), what it is and the call that loads it."""
    return {
        DCP_DIR: (
            "a torch.distributed.checkpoint (DCP) directory: load it with torch.distributed.checkpoint.load(state, "
            f"storage_reader=nvcomp_checkpoint.dcp.NvcompReader({where!r})) (NvcompReader reads ours and plain ones)"
        ),
        LIGHTNING_SHARDED_DIR: (
            "a Lightning sharded checkpoint (DCP shards and meta.pt): resume with trainer.fit(model, "
            f"ckpt_path={where!r}) under nvcomp_checkpoint.lightning.NvcompModelParallelStrategy or NvcompFSDPStrategy "
            "(they read ours and plain ones)"
        ),
        ACCELERATE_DIR: (
            f"an Accelerate save_state directory: load it with accelerator.load_state({where!r}), after "
            "nvcomp_checkpoint.accelerate.register_nvcomp_hooks(accelerator) if it holds .nvc files; "
            "nvcomp_checkpoint.load reads one .nvc file of it"
        ),
        HF_TRAINER_DIR: (
            f"a Hugging Face Trainer checkpoint: resume with trainer.train(resume_from_checkpoint={where!r}) "
            "and nvcomp_checkpoint.transformers.NvcompTrainerCallback (or NvcompTrainer); "
            "nvcomp_checkpoint.load reads one .nvc file of it"
        ),
    }


#: Names of files that a directory passed to ``load`` by mistake may hold, to suggest one of them.
_CHECKPOINT_SUFFIXES = (".nvc", ".ckpt", ".pt", ".pth", ".bin", ".safetensors")


def _directory_error(where: str, storage: Any, spath: str) -> FormatError | None:
    """If ``spath`` is a directory (or an object-store prefix), an error naming the call that loads
    it; None otherwise (``load`` / ``open`` then raise their own error)."""
    try:
        found = path_contents(storage, spath, where)
    except Exception:  # noqa: BLE001 - a failed look must not hide the original error
        return None
    if not found.is_dir:
        return None
    kind = found.directory_kind
    if kind is not None:
        return FormatError(
            f"{where}: is {_directory_loaders(where)[kind]}; nvcomp_checkpoint.load / open read one checkpoint file"
        )
    if not found.names:
        return FormatError(f"{where}: is an empty directory, not a checkpoint file")
    files = sorted(
        n for n, is_dir in found.names.items() if not is_dir and not n.startswith(".") and n.endswith(_CHECKPOINT_SUFFIXES)
    )
    hint = f"; it holds {', '.join(files[:3])}{' ...' if len(files) > 3 else ''}: pass one of them" if files else ""
    return FormatError(f"{where}: is a directory, not a checkpoint file{hint}")


@dataclass(frozen=True)
class VerifyProblem:
    """One thing :func:`verify` found wrong: in a tensor (its key), or in the file itself (``None``)."""

    tensor: str | None
    error: CheckpointError


@dataclass(frozen=True)
class VerifyResult:
    """What :func:`verify` checked in one file, and every problem it found."""

    path: str
    tensors: int
    raw_bytes: int
    problems: tuple[VerifyProblem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    max_bytes: int | None = None,
) -> VerifyResult:
    """Check a checkpoint file as ``load`` would read it, without keeping anything.

    The index is parsed, the object tree decoded with the weights-only rules and checked
    (every tensor reference points at a tensor of the index), and every chunk of every tensor
    checksummed and decoded. A file passes exactly when ``load(path)`` accepts it; tensors of
    nvCOMP-only codecs on a machine without a GPU are problems too (they cannot be loaded here).
    Tensors are decoded chunk by chunk, so memory stays near a chunk per worker (a delta
    tensor is rebuilt whole, as ``load`` does); time grows with the bytes decoded.

    Args:
        path: Local path or fsspec URL of an nvcomp-checkpoint file.
        storage_options: Passed to fsspec for URLs.
        progress: Called with the raw bytes of each tensor once it is checked.
        max_bytes: For files from untrusted sources: when the object tree and the tensors decode
            to more than this many bytes (counted as for :func:`load`), nothing is decoded and the
            result has one problem, a :class:`SizeLimitError` (a 135 KB file may declare 4 GiB
            of zeros, and the index alone up to 1 GiB of such frames). ``None``: no limit.
    """
    where = os.fspath(path)
    wait_for_path(path)
    problems: list[VerifyProblem] = []
    try:
        reader = CheckpointReader(path, storage_options=storage_options, max_bytes=max_bytes)
    except FormatError as exc:
        return VerifyResult(where, 0, 0, (VerifyProblem(None, exc),))
    with reader:
        try:
            for entry, error in reader.verify():
                if progress is not None:
                    progress(entry.nbytes)
                if isinstance(error, CheckpointError):
                    problems.append(VerifyProblem(entry.key, error))
        except CheckpointError as exc:  # the object tree is checked before any tensor
            problems.append(VerifyProblem(None, exc))
        return VerifyResult(where, len(reader.index.tensors), reader.raw_bytes, tuple(problems))
