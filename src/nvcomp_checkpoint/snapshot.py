"""Point-in-time copies of checkpoint trees, taken before an async save returns to training.

Tensors go to reusable memory (a host arena, or GPU memory within a budget); values are deep-copied.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .errors import CheckpointWriteError
from .format.skeleton import TensorRef, flatten, unflatten
from .policy import key_string
from .tensors import SOURCE_DEVICE_ATTR, flat_bytes

__all__ = ["Snapshot", "SnapshotBuffers", "SOURCE_DEVICE_ATTR"]

_LOG = logging.getLogger("nvcomp_checkpoint")

#: Bytes per unit of work of the host copy threads.
_PIECE = 8 << 20

#: Offsets of tensors inside an arena; 64 keeps every dtype view legal and cache-line aligned.
_ALIGN = 64

TensorList = Sequence[tuple[tuple[Any, ...], torch.Tensor]]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Snapshot:
    """A copy of a checkpoint tree that nothing but the pending save refers to.

    Taken with ``background=True``, host copies may still be running: :meth:`wait_copied`
    says when a tensor (or all of them) is copied.

    Attributes:
        skeleton: :func:`flatten`'s skeleton of the tree, its plain values copied.
        tensors: The copied tensors, in the skeleton's order (a tensor compressed on its GPU
            instead of copied is the caller's own; the writer reads only its shape and dtype).
        checked: What ``validate`` returned (the writer's plan of the caller's tensors).
        raw_bytes: Bytes of all tensors copied.
        host_bytes: Of those, bytes held in host memory.
        gpu_bytes: Of those, bytes held in GPU memory.
        seconds: Time taken to copy (for a background copy: until :meth:`wait_copied` of all).
    """

    skeleton: Any
    tensors: list[torch.Tensor]
    checked: Any
    raw_bytes: int
    host_bytes: int
    gpu_bytes: int
    seconds: float
    _release: Callable[[], None] = field(default=lambda: None, repr=False)
    #: ``{id(tensor): frames}`` of CUDA tensors compressed on their GPU instead of copied; the
    #: tree then holds the tensor itself, of which the writer reads only shape and dtype.
    pre_encoded: dict[int, Any] = field(default_factory=dict, repr=False)
    _copying: "_HostCopy | None" = field(default=None, repr=False)
    _started: float = field(default=0.0, repr=False)
    _tree: Any = field(default=None, repr=False)

    @property
    def tree(self) -> Any:
        """The copied tree (built on first use; the writer takes :attr:`skeleton` and :attr:`tensors`)."""
        if self._tree is None and self.skeleton is not None:
            # unflatten fills containers in place: it gets a copy of them, the skeleton stays.
            containers, _ = flatten(self.skeleton)
            tensors = self.tensors
            self._tree = unflatten(containers, lambda i: tensors[i])
        return self._tree

    def wait_copied(self, index: int | None = None) -> None:
        """Wait until tensor ``index`` of :attr:`tensors` (``None``: every tensor) is copied.

        Raises:
            CheckpointWriteError: That copy failed or was cancelled; names the tensor.
        """
        if self._copying is None:
            return
        self._copying.wait(index)
        if index is None:
            self.seconds = time.perf_counter() - self._started

    @property
    def copy_failed(self) -> bool:
        """True if a host copy failed or was cancelled (known for sure once every copy has ended)."""
        return self._copying is not None and self._copying.failed

    def cancel(self) -> None:
        """Stop the host copies not started yet, and wait for the running ones to end."""
        if self._copying is not None:
            self._copying.cancel()

    def release(self) -> None:
        """Return the memory to the pool it came from (call once the save is done).

        Host copies still running are waited for first: they write into that memory.
        """
        if self._copying is not None:
            self._copying.settle()
        release, self._release = self._release, lambda: None
        self.skeleton = self._tree = None
        self.tensors = []
        release()


class SnapshotBuffers:
    """The memory snapshots are copied into, kept across saves so a snapshot rarely allocates.

    Fresh host memory costs a page fault per 4 KiB on first touch, which for a checkpoint of
    some GiB takes longer than the copy itself; an arena reused from the previous save does not.

    Args:
        gpu_budget_bytes: GPU memory one snapshot may use for GPU tensors, per device. ``None``:
            a quarter of the device's free memory when the snapshot is taken; ``0``: always
            copy GPU tensors to host memory.
        pinned_bytes: Pinned host memory used to stage GPU tensors to host memory (two halves,
            so one is copied from the device while the other is copied out).
        reuse: Keep host arenas for later snapshots (at most ``max_pooled`` of them).
        max_pooled: Host arenas kept; one per save that may be pending at a time is enough.
    """

    def __init__(
        self,
        *,
        gpu_budget_bytes: int | None = None,
        pinned_bytes: int = 64 << 20,
        reuse: bool = True,
        max_pooled: int = 1,
    ) -> None:
        if gpu_budget_bytes is not None and gpu_budget_bytes < 0:
            raise ValueError(f"gpu_budget_bytes must be >= 0 or None, got {gpu_budget_bytes}")
        if pinned_bytes < (2 << 20):
            raise ValueError(f"pinned_bytes must be at least 2 MiB, got {pinned_bytes}")
        self.gpu_budget_bytes = gpu_budget_bytes
        self.pinned_bytes = pinned_bytes
        self.reuse = reuse
        self.max_pooled = max(0, max_pooled)
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._pinned: list[torch.Tensor] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        # Memory bandwidth is shared: past a few threads a copy gets no faster.
        self._threads = max(
            1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
        )

    # -- pools -------------------------------------------------------------------------------
    def _host_arena(self, need: int) -> torch.Tensor:
        with self._lock:
            fits = [a for a in self._free if a.numel() >= need]
            if fits:
                arena = min(fits, key=lambda a: a.numel())
                # By identity: list.remove compares tensors with ==, which fails between two arenas.
                self._free = [a for a in self._free if a is not arena]
                return arena
        return torch.empty(need, dtype=torch.uint8)

    def _give_back(self, arena: torch.Tensor) -> None:
        if not self.reuse or self.max_pooled == 0 or arena.numel() == 0:
            return
        with self._lock:
            self._free.append(arena)
            # Keep the largest: the next snapshot is most likely as big as the last ones.
            self._free.sort(key=lambda a: a.numel(), reverse=True)
            del self._free[self.max_pooled :]

    def _pinned_halves(self) -> list[torch.Tensor]:
        if self._pinned is None:
            half = self.pinned_bytes // 2
            self._pinned = [torch.empty(half, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        return self._pinned

    @property
    def pooled_bytes(self) -> int:
        """Host memory kept for the next snapshot."""
        with self._lock:
            return sum(a.numel() for a in self._free)

    def reset_after_fork(self) -> None:
        """In a forked child: a lock the parent's worker held stays held there, and CUDA memory
        of the parent is not the child's; start both afresh (the host arenas stay usable)."""
        self._lock = threading.Lock()
        self._pinned = None

    def clear(self) -> None:
        """Free every pooled buffer (host arenas and pinned staging memory)."""
        with self._lock:
            self._free.clear()
            self._pinned = None

    # -- snapshot ----------------------------------------------------------------------------
    def take(
        self,
        obj: Any,
        validate: Callable[[TensorList], Any] | None = None,
        pre_encode: Callable[[TensorList, Callable[[torch.device], int]], dict[int, Any]] | None = None,
        where: str = "checkpoint",
        background: bool = False,
    ) -> Snapshot:
        """Copy ``obj``: every tensor into memory of this pool, containers and values deep.

        Args:
            obj: A checkpoint tree (dicts, lists, tuples, tensors, plain values).
            validate: Called with the tree's ``(path, tensor)`` list before anything is copied,
                so that a tree the writer would refuse fails here, on the caller's thread; what
                it returns is kept as :attr:`Snapshot.checked`.
            pre_encode: Compresses CUDA tensors on their GPU within a per-device budget and
                returns ``{id(tensor): frames}``; those tensors are not copied (their compressed
                frames are the snapshot). ``None``: every tensor is copied.
            where: The file being saved, for error messages.
            background: Return while the copy threads still copy host tensors (in the tree's
                order): :meth:`Snapshot.wait_copied` waits for them, and the caller must, before
                its tensors change. Copies to GPU memory or staged from it are done on return.

        Returns:
            A :class:`Snapshot`; call :meth:`Snapshot.release` when the save is done.

        Raises:
            CheckpointWriteError: A copy failed (without ``background``); names the tensor.
        """
        start = time.perf_counter()
        skeleton, tensors = flatten(obj, where=where)
        checked = validate(tensors) if validate is not None else None
        skeleton = _copy_plain(skeleton)
        all_tensors = tensors
        pre_encoded: dict[int, Any] = {}
        if pre_encode is not None:
            pre_encoded = pre_encode(tensors, self._gpu_budget)
        # What was compressed on the GPU is not copied; the rest is, as below.
        positions = [i for i, (_, t) in enumerate(all_tensors) if id(t) not in pre_encoded]
        tensors = [all_tensors[i] for i in positions]
        # An explicit budget covers both parts; a default one is measured after the compression.
        pre_used: dict[torch.device, int] = {}
        if self.gpu_budget_bytes is not None:
            for _, t in all_tensors:
                if id(t) in pre_encoded:
                    pre_used[t.device] = pre_used.get(t.device, 0) + _aligned(_nbytes(t))

        on_gpu = self._gpu_placement(tensors, pre_used)
        while True:
            offsets: list[int] = []
            host_need = 0
            for i, (_, t) in enumerate(tensors):
                offsets.append(host_need)
                if i not in on_gpu:
                    host_need += _aligned(_nbytes(t))
            arena = self._host_arena(host_need) if host_need else torch.empty(0, dtype=torch.uint8)
            gpu_arenas: dict[torch.device, torch.Tensor] = {}
            copying: _HostCopy | None = None
            try:
                copies, staged, gpu_bytes, host_pieces = self._copy_all(tensors, offsets, arena, on_gpu, gpu_arenas)
                # Host copies start first: staging GPU tensors (below) overlaps them.
                copying = self._copy_host(
                    [(dst, src, positions[i]) for dst, src, i in host_pieces],
                    lambda i: key_string(all_tensors[i][0]),
                    where,
                )
                for device, pairs in staged.items():
                    self._stage_to_host(device, pairs)
                for device in {t.device for _, t in tensors if t.device.type == "cuda"}:
                    # Copies run on the caller's current stream; training may overwrite the
                    # sources the moment we return, so they must be complete first.
                    torch.cuda.current_stream(device).synchronize()
                if not background:
                    copying.wait(None)
                break
            except _RetryOnHost as exc:
                gpu_arenas.clear()
                self._give_back(arena)
                on_gpu = {i for i in on_gpu if tensors[i][1].device != exc.device}
            except BaseException:
                if copying is not None:
                    copying.cancel()  # nothing may still write into the arena given back
                gpu_arenas.clear()
                self._give_back(arena)
                raise
        copied = iter(copies)
        merged = [t if id(t) in pre_encoded else next(copied) for _, t in all_tensors]
        raw = sum(_nbytes(t) for _, t in all_tensors)
        encoded_bytes = sum(f.numel() for batches in pre_encoded.values() for frames, _ in batches for f in frames)
        gpu_bytes += encoded_bytes

        def release() -> None:
            encoded_on = {t.device for _, t in all_tensors if id(t) in pre_encoded and t.device.type == "cuda"}
            for device in set(gpu_arenas) | encoded_on:
                # The save's kernels (on streams other than the one the arena was allocated on)
                # must be done before the caching allocator hands the memory to training again.
                torch.cuda.synchronize(device)
            gpu_arenas.clear()
            self._give_back(arena)
            pre_encoded.clear()

        host_bytes = sum(_nbytes(t) for _, t in tensors) - (gpu_bytes - encoded_bytes)
        return Snapshot(
            skeleton,
            merged,
            checked,
            raw,
            host_bytes,
            gpu_bytes,
            time.perf_counter() - start,
            release,
            pre_encoded,
            _copying=None if copying.done() else copying,
            _started=start,
        )

    def _gpu_placement(self, tensors: TensorList, used: dict[torch.device, int] | None = None) -> set[int]:
        """Indices of CUDA tensors whose copy stays on their GPU (within the budget, of which
        ``used`` is already taken)."""
        chosen: set[int] = set()
        used = dict(used or {})
        budgets: dict[torch.device, int] = {}
        for i, (_, t) in enumerate(tensors):
            if t.device.type != "cuda":
                continue
            if t.device not in budgets:
                budgets[t.device] = self._gpu_budget(t.device)
            need = _aligned(_nbytes(t))
            if used.get(t.device, 0) + need <= budgets[t.device]:
                used[t.device] = used.get(t.device, 0) + need
                chosen.add(i)
        return chosen

    def _gpu_budget(self, device: torch.device) -> int:
        if self.gpu_budget_bytes is not None:
            return self.gpu_budget_bytes
        free, _ = torch.cuda.mem_get_info(device)
        return free // 4

    def _copy_all(
        self,
        tensors: TensorList,
        offsets: list[int],
        arena: torch.Tensor,
        on_gpu: set[int],
        gpu_arenas: dict[torch.device, torch.Tensor],
    ) -> tuple[list[torch.Tensor], dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]], int, list[_Piece]]:
        """Copy what is not a plain host copy; returns the copies, the CUDA tensors to stage
        to host memory, the bytes kept on GPUs and the host copies still to make."""
        gpu_offsets: dict[int, int] = {}
        gpu_need: dict[torch.device, int] = {}
        for i in sorted(on_gpu):
            t = tensors[i][1]
            gpu_offsets[i] = gpu_need.get(t.device, 0)
            gpu_need[t.device] = gpu_offsets[i] + _aligned(_nbytes(t))
        for device, need in gpu_need.items():
            try:
                gpu_arenas[device] = torch.empty(need, dtype=torch.uint8, device=device)
            except torch.OutOfMemoryError:
                # The budget was a guess; training's own peak got there first. Stage instead.
                _LOG.info("async snapshot: %d bytes did not fit on %s; staging through host memory", need, device)
                raise _RetryOnHost(device) from None

        copies: list[torch.Tensor] = []
        staged: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        host_pieces: list[_Piece] = []
        gpu_bytes = 0
        for i, (_, src) in enumerate(tensors):
            n = _nbytes(src)
            if i in on_gpu:
                flat = gpu_arenas[src.device][gpu_offsets[i] : gpu_offsets[i] + n]
                gpu_bytes += n
            else:
                flat = arena[offsets[i] : offsets[i] + n]
            dst = _typed(flat, src)
            if src.device.type == "cuda" and i not in on_gpu:
                staged.setdefault(src.device, []).append((src, flat))
            elif n and _plain_host(src):
                src_bytes = flat_bytes(src).numpy()
                dst_bytes = flat.numpy()
                for start in range(0, n, _PIECE):
                    host_pieces.append((dst_bytes[start : start + _PIECE], src_bytes[start : start + _PIECE], i))
            elif n:
                dst.copy_(src.detach())  # strided, lazily conjugated, or on another device
            copies.append(_like(dst, src))
        return copies, staged, gpu_bytes, host_pieces

    def _copy_host(self, pieces: list[_Piece], name: Callable[[int], str], where: str) -> "_HostCopy":
        """memcpy on a few threads that take jobs of about ``_PIECE`` bytes, in order, as they go.

        torch's ``copy_`` splits each tensor over OpenMP threads that wait for each other, so one
        preempted thread stalls the copy: on a busy 2-core machine it ran at 0.6 GB/s against
        10-15 GB/s for this (``benchmarks/bench_async.py``). Small tensors are batched into one
        job: a job per tensor (500+ for a model with its AdamW state) spent more time handing
        futures between threads than copying (``benchmarks/README.md``, async saves of bf16).
        """
        total = sum(piece[0].nbytes for piece in pieces)
        if total < (32 << 20) or self._threads <= 1:
            return _HostCopy([pieces], None, name, where)
        jobs: list[list[_Piece]] = [[]]
        size = 0
        for piece in pieces:
            if size >= _PIECE:
                jobs.append([])
                size = 0
            jobs[-1].append(piece)
            size += piece[0].nbytes
        return _HostCopy(jobs, self._copy_pool(), name, where)

    def _copy_pool(self) -> ThreadPoolExecutor:
        # A pool inherited through fork has no threads behind it: make a new one in the child.
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="nvckpt-snapshot")
            self._pool_pid = os.getpid()
        return self._pool

    def _stage_to_host(self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy CUDA tensors into host memory through two pinned buffers.

        The device-to-pinned copy of one piece (DMA, asynchronous) overlaps the pinned-to-arena
        copy of the previous one (CPU), and pinned memory stays at ``pinned_bytes``.
        """
        halves = self._pinned_halves()
        half = halves[0].numel()
        stream = torch.cuda.current_stream(device)
        inflight: deque[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = deque()

        def drain() -> None:
            event, buf, dst = inflight.popleft()
            event.synchronize()
            np.copyto(dst.numpy(), buf.numpy())

        slot = 0
        with torch.cuda.device(device):
            for src, dst in pairs:
                flat = flat_bytes(src)
                for start in range(0, flat.numel(), half):
                    if len(inflight) == 2:
                        drain()  # frees the half this piece goes into
                    length = min(half, flat.numel() - start)
                    buf = halves[slot][:length]
                    slot ^= 1
                    buf.copy_(flat[start : start + length], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    inflight.append((event, buf, dst[start : start + length]))
            while inflight:
                drain()


#: A host copy to make: (destination bytes, source bytes, index of the tensor in the tree).
_Piece = tuple[np.ndarray, np.ndarray, int]


def _copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src)


def _copy_pieces(pieces: list[_Piece]) -> None:
    for dst, src, index in pieces:
        try:
            _copy_bytes(dst, src)
        except Exception as exc:
            raise _CopyFailed(index) from exc


class _CopyFailed(Exception):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class _HostCopy:
    """Host copy jobs of one snapshot, in the tree's order: which jobs hold each tensor's bytes.

    With ``pool`` None the jobs run at once, in the calling thread.
    """

    def __init__(self, jobs: list[list[_Piece]], pool: ThreadPoolExecutor | None, name: Callable[[int], str], where: str) -> None:
        self._name, self._where = name, where
        self._spans: dict[int, tuple[int, int]] = {}
        self._first = [job[0][2] if job else -1 for job in jobs]  # a job's first tensor, to name it
        for j, job in enumerate(jobs):
            for _, _, index in job:
                first = self._spans.get(index, (j, j))[0]
                self._spans[index] = (first, j)
        if pool is not None:
            self._futures = [pool.submit(_copy_pieces, job) for job in jobs]
            return
        self._futures = []
        for job in jobs:
            fut: Future[None] = Future()
            try:
                _copy_pieces(job)
                fut.set_result(None)
            except _CopyFailed as exc:
                fut.set_exception(exc)
            self._futures.append(fut)

    def done(self) -> bool:
        """Every job has ended (copied, failed or cancelled) and none failed."""
        return all(f.done() for f in self._futures) and not self.failed

    @property
    def failed(self) -> bool:
        return any(f.done() and (f.cancelled() or f.exception() is not None) for f in self._futures)

    def wait(self, index: int | None) -> None:
        """Wait for the jobs of tensor ``index`` (``None``: all); raise if one of them failed."""
        if index is None:
            jobs = range(len(self._futures))
        elif index in self._spans:
            first, last = self._spans[index]
            jobs = range(first, last + 1)
        else:
            return  # nothing of it is copied here (empty, on a GPU, or copied in take())
        for j in jobs:
            try:
                self._futures[j].result()
            except CancelledError:
                raise CheckpointWriteError(
                    f"{self._where}: the save was stopped before tensor {self._name(self._first[j])!r} "
                    "was copied; nothing was written, and any previous file at this path is untouched"
                ) from None
            except _CopyFailed as exc:
                cause = exc.__cause__
                raise CheckpointWriteError(
                    f"{self._where}: the async snapshot could not copy tensor {self._name(exc.index)!r} ({cause!r}); "
                    "nothing was written, and any previous file at this path is untouched"
                ) from cause

    def cancel(self) -> None:
        """Cancel the jobs not started; wait for the running ones."""
        for fut in self._futures:
            fut.cancel()
        self.settle()

    def settle(self) -> None:
        """Wait until no job runs any more, whatever its outcome."""
        for fut in self._futures:
            if not fut.cancelled():
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001 - the outcome is read through wait()
                    pass


class _RetryOnHost(Exception):
    def __init__(self, device: torch.device) -> None:
        super().__init__(str(device))
        self.device = device


def _plain_host(t: torch.Tensor) -> bool:
    """A CPU tensor whose bytes can be copied as they lie in memory."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _typed(flat: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``flat`` (uint8 bytes) seen as a contiguous tensor of ``src``'s dtype and shape."""
    if flat.numel() == 0:
        return torch.empty(src.shape, dtype=src.dtype, device=flat.device)
    return flat.view(src.dtype).view(src.shape)


def _like(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst`` dressed as ``src``: a Parameter if it was one, ``requires_grad``, source device."""
    if isinstance(src, torch.nn.Parameter):
        out: torch.Tensor = torch.nn.Parameter(dst, requires_grad=src.requires_grad)
    elif src.requires_grad:
        out = dst.detach().requires_grad_(True)
    else:
        out = dst
    if out.device != src.device:
        setattr(out, SOURCE_DEVICE_ATTR, str(src.device))
    return out


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size, TensorRef)


def _copy_plain(skeleton: Any) -> Any:
    """Deep-copy the non-tensor leaves, so later changes to counters or lists are not saved.

    :func:`flatten` already copied every dict, list and tuple; only mutable leaves (numpy RNG
    state, custom objects) need copying, and ``copy.deepcopy`` of the whole tree costs ~10x more.
    """

    def leaf(value: Any) -> Any:
        if isinstance(value, _IMMUTABLE):
            return value
        try:
            return copy.deepcopy(value)
        except Exception as exc:  # an object that cannot be copied is saved as it is at write time
            _LOG.debug("async snapshot: %s is not deep-copyable (%s); saving it by reference", type(value).__name__, exc)
            return value

    def walk(node: Any) -> Any:
        if isinstance(node, (dict, list)):
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in list(items):
                node[key] = walk(value)
            return node
        if isinstance(node, tuple):
            walked = [walk(v) for v in node]
            if hasattr(node, "_fields"):  # namedtuple
                return type(node)(*walked)
            return type(node)(walked) if type(node) is not tuple else tuple(walked)
        return leaf(node)

    return walk(skeleton)
