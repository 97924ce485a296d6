"""nvCOMP GPU codecs: compress and decompress batches of uint8 CUDA tensors with nvCOMP 6.x.

``zstd`` writes standard Zstd frames that libzstd reads, so the CPU codec of the same id loads
them; ``ans``, ``bitcomp``, ``gdeflate`` and ``cascaded`` are GPU-only formats.

Every frame is exactly one nvCOMP chunk in the RAW bitstream: no nvCOMP header and no nvCOMP
chunking, so a frame's bytes are the algorithm's own format. Sizes, offsets and checksums live
in the checkpoint index, not in the frame.

Nothing here imports ``nvidia.nvcomp`` or touches CUDA at import time, so the module imports
on a machine without a GPU. API facts are cited from the nvCOMP 6.0.0 wheel's own docstrings
(``help(nvidia.nvcomp.Codec)`` in ``nvidia-nvcomp-cu13==6.0.0.12``; the same text is at
https://docs.nvidia.com/cuda/nvcomp/py_api.html) and its C headers
(``nvidia-libnvcomp-cu13==6.0.0.12``: ``include/nvcomp/*.h``).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import CodecUnavailableError, FormatError, GpuCodecError, GpuOutOfMemoryError
from ..version import install_hint
from .cpu import ZstdCpuCodec
from .registry import CHUNK_CAP_BYTES, CODEC_FACTS, codec_facts, nvcomp_options
from .zstd_frame import gpu_safe_reason

__all__ = [
    "INSTALL_HINT",
    "MAX_ZSTD_FRAME_BYTES",
    "MAX_CHUNK_BYTES",
    "EMPTY_ZSTD_FRAME",
    "NvcompGpuCodec",
    "NoneGpuCodec",
    "gpu_codec",
    "is_available",
    "unavailable_reason",
    "zstd_frames_for_host",
]

#: What to install; named in every error that says nvCOMP or CUDA is missing.
INSTALL_HINT = (
    "install the nvCOMP extra that matches your CUDA driver, cu12 (CUDA 12 driver) or cu13 (CUDA 13 driver): "
    f"{install_hint('cu12')}"
)

#: Largest raw chunk nvCOMP compresses as one chunk, per codec: the facts table's
#: ``gpu_max_chunk_bytes`` (codecs/registry.py cites the nvCOMP 6.0 headers behind each number).
MAX_CHUNK_BYTES: dict[str, int] = {
    **{f.id: f.gpu_max_chunk_bytes for f in CODEC_FACTS.values() if f.nvcomp_algorithm},
    "none": sys.maxsize,
}
#: Largest zstd frame nvCOMP compresses (zstd.h: "Chunk sizes must not exceed 16 MB").
MAX_ZSTD_FRAME_BYTES = MAX_CHUNK_BYTES["zstd"]

#: The frame libzstd writes for empty input (``zstandard.ZstdCompressor(level=1).compress(b"")``).
#: nvCOMP rejects zero-byte buffers ("each entry must be greater than zero",
#: ``Codec.compression_config``), so an empty chunk is encoded here without the GPU, as the
#: standard frame the CPU decoder reads back as b"".
EMPTY_ZSTD_FRAME = bytes.fromhex("28b52ffd2000010000")

# nvCOMP's algorithm name of each codec id, from the facts table. Every GPU-only codec is told
# its data is bytes (the table's options give data_type "|u1"): nvCOMP's float modes are for
# IEEE types, and bf16 through ANS as "<f2" did not round-trip (NVIDIA/CUDALibrarySamples
# issue 249), so tensors of any dtype reach nvCOMP as uint8.
_ALGORITHMS = {f.id: f.nvcomp_algorithm for f in CODEC_FACTS.values() if f.nvcomp_algorithm}

# Bound on the per-thread cache of nvcomp.Codec objects: one per (device, stream) a thread
# has used; a long-lived thread that cycles through many streams must not keep them all.
_CODECS_PER_THREAD = 16


def _import_nvcomp() -> Any:
    """``nvidia.nvcomp``, imported on first use so this module imports without it."""
    from nvidia import nvcomp  # noqa: PLC0415 - optional GPU dependency

    return nvcomp


def unavailable_reason(codec_id: str = "zstd") -> str | None:
    """Why ``codec_id`` cannot run on the GPU here, or None when it can be tried.

    Checks, without creating a CUDA context: PyTorch sees a CUDA device, and (except for
    ``none``, a plain device copy) the ``nvidia.nvcomp`` module imports. A driver too old for
    the installed wheel only shows when the first codec is built; :func:`gpu_codec` callers
    then get a :class:`CodecUnavailableError` from the first ``encode_batch``/``decode_batch``.
    """
    try:
        if not torch.cuda.is_available():
            return "PyTorch sees no CUDA device (no GPU, no driver, or a CPU-only PyTorch build)"
    except Exception as exc:  # a broken driver install can raise here; is_available never does
        return f"PyTorch could not query CUDA: {exc}"
    if codec_id == "none":
        return None
    try:
        _import_nvcomp()
    except ImportError as exc:
        return f"the nvCOMP Python package (module nvidia.nvcomp) is not installed ({exc})"
    except Exception as exc:  # the wheel's loader dlopens libnvcomp.so.6 at import
        return f"the nvCOMP Python package failed to load: {exc}"
    return None


def is_available() -> bool:
    """True when a CUDA device and the nvCOMP Python package can both be used. Never raises."""
    try:
        return unavailable_reason() is None
    except Exception:
        return False


def _codec_options(codec_id: str, level: int | None) -> dict[str, Any]:
    """The algorithm-specific ``nvcomp.Codec`` keyword options for ``codec_id`` at ``level``.

    Option names and ranges are those of ``help(nvidia.nvcomp.Codec.__init__)`` in nvCOMP 6.0,
    kept in the facts table (codecs/registry.py). Levels only change how hard the encoder
    works; decoders ignore them. nvCOMP's Zstd has no level (its options are "Currently
    empty", zstd.h): the level is the CPU encoder's only.

    Raises:
        ValueError: ``level`` is outside the range the codec accepts.
    """
    return nvcomp_options(codec_id, level)


def _as_byte_chunk(tensor: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """``tensor`` as a 1-D contiguous uint8 view on ``device``, or a ValueError saying why not.

    Any dtype is accepted and reinterpreted as its bytes (bf16 included): nvCOMP must only
    ever see bytes (module comment on ``_ALGORITHMS``).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device != device:
        raise ValueError(f"{what} is on {tensor.device}, this codec runs on {device}; move it with .to({device})")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous; call .contiguous() first")
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _to_torch_bytes(array: Any, device: torch.device) -> torch.Tensor:
    """A uint8 torch view of an ``nvcomp.Array`` on ``device``, without copying.

    ``help(nvidia.nvcomp.Array)`` lists three exports: the DLPack protocol
    (``__dlpack__``/``__dlpack_device__``), a DLPack capsule (``to_dlpack``) and
    ``__cuda_array_interface__``; they are tried in that order. Decoded arrays may come back
    as int8 (NVIDIA/CUDALibrarySamples nvCOMP/examples/python/nvcomp_basic.ipynb shows
    ``'typestr': '|i1'`` for a decode), hence the byte view.
    """
    attempts = (
        lambda: torch.from_dlpack(array),
        lambda: torch.from_dlpack(array.to_dlpack()),
        lambda: torch.as_tensor(array, device=device),
    )
    first_error: Exception | None = None
    for attempt in attempts:
        try:
            tensor = attempt()
            break
        except Exception as exc:  # which exchange path works is settled on the GPU, not here
            first_error = first_error or exc
    else:
        raise GpuCodecError(f"could not view an nvCOMP array as a torch tensor: {first_error!r}") from first_error
    tensor = tensor.reshape(-1)
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)


#: What nvCOMP and the buffer exchange with torch raise. nvCOMP's own errors come as RuntimeError
#: or ValueError; torch's DLPack export raises BufferError, or AssertionError for a stream it
#: refuses; a keyword or attribute the installed bindings do not have raises TypeError or
#: AttributeError; torch raises torch.cuda.OutOfMemoryError (a RuntimeError).
_EXCHANGE_ERRORS = (BufferError, AssertionError)
_BINDING_ERRORS = (RuntimeError, ValueError, TypeError, AttributeError, MemoryError, *_EXCHANGE_ERRORS)
_OOM_MARKERS = ("out of memory", "cudaerrormemoryallocation", "cuda_error_out_of_memory")
#: CUDA faults, as nvCOMP ("Encountered Cuda Error from previous asynchronous launches") and torch
#: word them. After one the CUDA context may be unusable for the rest of the process.
_CUDA_FAULT_MARKERS = ("cuda error", "cudaerror", "cuda_error", "illegal memory access", "launch failure", "cuda driver")


def _bindings_version() -> str:
    try:
        return f"nvidia.nvcomp {_import_nvcomp().__version__}"
    except Exception:  # noqa: BLE001 - only for the message
        return "nvidia.nvcomp (version unknown)"


def _device_error(exc: BaseException, what: str) -> GpuCodecError | None:
    """The error for ``exc`` when the GPU stack, not the data, is at fault; None otherwise.

    Out of memory, a CUDA fault, a binding that does not take our call, or torch and nvCOMP
    failing to exchange a buffer say nothing about the file, so they are never a FormatError:
    the same file may load on the CPU or after a restart.
    """
    text = str(exc)
    low = text.lower()
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or any(m in low for m in _OOM_MARKERS):
        return GpuOutOfMemoryError(
            f"{what}: the GPU ran out of memory ({text}). Free GPU memory (torch.cuda.empty_cache(), "
            "smaller batches), or load with map_location='cpu' (zstd decodes on the CPU too)"
        )
    if isinstance(exc, (TypeError, AttributeError)):
        return GpuCodecError(
            f"{what}: the installed nvCOMP bindings ({_bindings_version()}) do not take this call: {exc!r}. "
            f"nvcomp-checkpoint is written against nvCOMP 6.0; {INSTALL_HINT}"
        )
    if isinstance(exc, _EXCHANGE_ERRORS):
        return GpuCodecError(f"{what}: torch and nvCOMP could not exchange a buffer: {exc!r}")
    if any(m in low for m in _CUDA_FAULT_MARKERS):
        return GpuCodecError(
            f"{what}: CUDA failed ({text}). The CUDA context may now be unusable: restart the process; "
            "to load this file without the GPU use map_location='cpu' (zstd)"
        )
    return None


class _CudaBuffer:
    """A CUDA tensor shown to nvCOMP through ``__cuda_array_interface__`` only.

    ``nvcomp.as_arrays`` takes objects with ``__cuda_array_interface__``, ``__array_interface__``
    or ``__dlpack__``. Through DLPack, nvCOMP would pass its ``cuda_stream`` (default 0) to
    ``torch.Tensor.__dlpack__``, which refuses 0 on CUDA with an AssertionError ("unsupported
    stream"), and 0 is also what ``torch.cuda.current_stream().cuda_stream`` is on the default
    stream. The interface torch exports (version 2) carries no stream, and none is needed: the
    nvCOMP Codec runs on the same stream that produced the tensor (see ``NvcompGpuCodec._codec``).
    The wrapper keeps the tensor alive as long as nvCOMP keeps the wrapper.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.tensor.__cuda_array_interface__


def zstd_frames_for_host(
    host_frames: Sequence[bytes | bytearray | memoryview], raw_sizes: Sequence[int], gpu_decode_max_bytes: int
) -> dict[int, str]:
    """Which zstd frames libzstd must decode instead of nvCOMP, each with the reason.

    A frame goes to nvCOMP only if :func:`~nvcomp_checkpoint.codecs.zstd_frame.gpu_safe_reason`
    finds its headers sound and its size is one nvCOMP was checked to decode (the facts table's
    ``gpu_decode_max_bytes``). Everything else goes to libzstd, which checks all of it: a frame
    that is valid but unusual still loads, a corrupt one raises FormatError, and neither can
    leave a sticky CUDA error.
    """
    out: dict[int, str] = {}
    for k, (frame, raw_size) in enumerate(zip(host_frames, raw_sizes, strict=True)):
        if raw_size > gpu_decode_max_bytes:
            out[k] = f"{raw_size} bytes is over the {gpu_decode_max_bytes} that nvCOMP is known to decode"
            continue
        reason = gpu_safe_reason(frame, raw_size)
        if reason is not None:
            out[k] = reason
    return out


#: Where every buffer handed to nvCOMP starts: "Each chunk must be aligned to the value in the
#: `input` member of the nvcompAlignmentRequirements_t" of its algorithm (nvCOMP 6.0 headers: 4 to 8
#: bytes for zstd, bitcomp, cascaded and gdeflate, 16 for ANS); the as_arrays docstring: "If in
#: doubt, use 16B alignment".
NVCOMP_ALIGNMENT = 16


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or an aligned copy of it (byte planes and file frames start anywhere)."""
    if tensor.numel() == 0 or tensor.data_ptr() % NVCOMP_ALIGNMENT == 0:
        return tensor
    return tensor.clone()  # the caching allocator's blocks are 512-byte aligned


def _pack_aligned(views: list[Any], sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    """Copy nvCOMP's output arrays into one torch allocation, each at an aligned offset.

    Returns views of exactly ``sizes[i]`` bytes, so a frame made here can go back to nvCOMP as it is.
    """
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // NVCOMP_ALIGNMENT) * NVCOMP_ALIGNMENT
    packed = torch.empty(total, dtype=torch.uint8, device=device)
    out = []
    for view, size, offset in zip(views, sizes, offsets, strict=True):
        dest = packed[offset : offset + size]
        dest.copy_(_exact_bytes(view, size, device))
        out.append(dest)
    return out


def _exact_bytes(array: Any, size: int, device: torch.device) -> torch.Tensor:
    """The first ``size`` bytes of an ``nvcomp.Array``, whose export should be exactly that long."""
    tensor = _to_torch_bytes(array, device)
    if tensor.numel() < size:
        raise GpuCodecError(f"nvCOMP array exports {tensor.numel()} bytes but reports buffer_size {size}")
    return tensor[:size]


class NvcompGpuCodec:
    """One nvCOMP algorithm on one CUDA device, safe to share between threads.

    Each thread gets its own ``nvcomp.Codec`` per (device, CUDA stream): a Codec "holds
    mutable internal state (compression manager, scratch buffers)" and "must not be called
    from multiple threads concurrently" (nvCOMP 6 Python API, "Thread-safety guarantees").
    The Codec is bound to the caller's current PyTorch stream on the device, so nvCOMP's work
    is ordered after the kernels that produced the input and before whatever reads the output.

    Attributes:
        id: The codec id (``"zstd"``, ``"ans"``, ``"bitcomp"``, ``"gdeflate"``, ``"cascaded"``).
        level: The level the codec was asked for (None: nvCOMP's default).
        device: The CUDA device, with its index resolved.
        max_chunk_bytes: Largest raw chunk one frame may hold when compressing
            (:data:`MAX_CHUNK_BYTES`, the facts table's ``gpu_max_chunk_bytes``).
        host_decoded: Frames :meth:`decode_batch` handed to libzstd instead of nvCOMP so far.
    """

    def __init__(self, codec_id: str, level: int | None, device: torch.device) -> None:
        if codec_id not in _ALGORITHMS:
            raise ValueError(f"no nvCOMP algorithm for codec {codec_id!r}")
        facts = codec_facts(codec_id)
        self.id = codec_id
        self.level = level
        self.device = device
        self.max_chunk_bytes = MAX_CHUNK_BYTES[codec_id]
        # A file's frames may be as large as the format's chunk cap (a zstd file written on the
        # CPU); above gpu_decode_max_bytes a portable frame is decoded by libzstd instead.
        self._max_raw_bytes = CHUNK_CAP_BYTES if facts.portable else facts.gpu_decode_max_bytes
        self._gpu_decode_max_bytes = facts.gpu_decode_max_bytes
        self._algorithm = _ALGORITHMS[codec_id]
        self._options = _codec_options(codec_id, level)  # validates the level now, not mid-save
        self._local = threading.local()
        self._host_codec = ZstdCpuCodec() if codec_id == "zstd" else None
        self.host_decoded = 0

    def __repr__(self) -> str:
        return f"NvcompGpuCodec(id={self.id!r}, level={self.level!r}, device={self.device})"

    def _codec(self, stream: torch.cuda.Stream) -> Any:
        """This thread's ``nvcomp.Codec`` for ``stream`` (created on first use)."""
        cache: OrderedDict[int, Any] | None = getattr(self._local, "codecs", None)
        if cache is None:
            cache = self._local.codecs = OrderedDict()
        key = int(stream.cuda_stream)
        codec = cache.get(key)
        if codec is not None:
            cache.move_to_end(key)
            return codec
        nvcomp = _import_nvcomp()
        try:
            # RAW: "Compresses input data as is, just using underlying compression algorithm.
            # Does not add header with nvCOMP metadata" (BitstreamKind docstring). The default,
            # NVCOMP_NATIVE, prepends an nvCOMP header that libzstd cannot read (docs/facts.md,
            # NVIDIA/CUDALibrarySamples issue 208). uncomp_chunk_size is not passed: it sets the
            # NVCOMP_NATIVE chunking ("For NVCOMP_NATIVE, this must be a multiple of ..."), while
            # RAW compresses each buffer as one chunk (inferred from the RAW sizes printed in
            # NVIDIA/CUDALibrarySamples nvCOMP/examples/python/nvcomp_basic.ipynb, e.g. Cascaded
            # RAW = input + 8 bytes; tests/test_gpu_codecs.py checks a 4 MiB zstd frame is one
            # frame). The Codec runs on the caller's torch stream, passed as a raw cudaStream_t
            # (0 for the default stream), as zarr-python's nvCOMP Zstd codec does with CuPy's
            # current stream (zarr-developers/zarr-python PR 2863, NvcompZstdCodec._zstd_codec).
            # device_id must match the tensors' device or nvCOMP raises "Input array and Codec
            # device id mismatched" (fal-ai/flashpack, src/flashpack/deserialization.py).
            codec = nvcomp.Codec(
                algorithm=self._algorithm,
                bitstream_kind=nvcomp.BitstreamKind.RAW,
                device_id=self.device.index,
                cuda_stream=key,
                **self._options,
            )
        except Exception as exc:
            device_error = _device_error(exc, f"creating an nvCOMP {self._algorithm} codec on {self.device}")
            if device_error is not None and (
                isinstance(exc, (TypeError, AttributeError, MemoryError)) or isinstance(device_error, GpuOutOfMemoryError)
            ):
                raise device_error from exc  # a binding mismatch or no memory: not a missing install
            # On a machine whose driver is older than the wheel's CUDA, this is where it shows:
            # "CUDA driver version is insufficient for CUDA runtime version" (docs/facts.md, nvCOMP).
            raise CodecUnavailableError(
                f"nvCOMP could not create a {self._algorithm} codec on {self.device}: {exc}. "
                f"Check that the nvCOMP wheel matches the CUDA driver; {INSTALL_HINT}"
            ) from exc
        cache[key] = codec
        while len(cache) > _CODECS_PER_THREAD:
            cache.popitem(last=False)
        return codec

    def encode_batch(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Compress each chunk into one frame, all chunks in one nvCOMP batch.

        Args:
            chunks: 1-D contiguous CUDA tensors on :attr:`device`, each at most
                :attr:`max_chunk_bytes` bytes; any dtype is compressed as its bytes.

        Returns:
            One uint8 CUDA tensor per chunk holding exactly one frame (its compressed size).
            Frames of one call may be views into one shared allocation.

        Raises:
            ValueError: A chunk is on another device, not contiguous, or too large.
            GpuOutOfMemoryError: The GPU ran out of memory.
            GpuCodecError: nvCOMP or CUDA failed (a GpuCodecError is a RuntimeError).
        """
        frames: list[torch.Tensor | None] = [None] * len(chunks)
        todo_index: list[int] = []
        todo: list[torch.Tensor] = []
        for i, chunk in enumerate(chunks):
            data = _as_byte_chunk(chunk, self.device, f"chunk {i}")
            if data.numel() > self.max_chunk_bytes:
                raise ValueError(
                    f"chunk {i} holds {data.numel()} bytes; nvCOMP {self._algorithm} takes at most "
                    f"{self.max_chunk_bytes} bytes per chunk: split it into smaller chunks"
                )
            if data.numel() == 0:
                frames[i] = self._empty_frame()
                continue
            todo_index.append(i)
            todo.append(data)
        if todo:
            for i, frame in zip(todo_index, self._encode(todo), strict=True):
                frames[i] = frame
        return frames  # type: ignore[return-value]  # every slot is filled above

    def decode_batch(
        self,
        frames: Sequence[torch.Tensor],
        raw_sizes: Sequence[int],
        *,
        host_frames: Sequence[bytes | bytearray | memoryview] | None = None,
    ) -> list[torch.Tensor]:
        """Decompress frames written by :meth:`encode_batch` (or, for ``zstd``, by libzstd).

        Zstd frames are checked on the host first (:func:`zstd_frames_for_host`): only frames
        whose headers are sound reach nvCOMP, whose decoder must never see invalid input; the
        others are decoded by libzstd and copied to the device. GPU-only codecs have no CPU
        decoder; for them the reader's per-frame xxh3 checksum is the check.

        Args:
            frames: 1-D uint8 CUDA tensors on :attr:`device`, exactly one frame each.
            raw_sizes: The decompressed size of each frame, from the checkpoint index.
            host_frames: The same frames in host memory, when the caller has them (the reader
                read them from the file). Without them, zstd frames are copied back from the
                device to be checked.

        Returns:
            One uint8 CUDA tensor per frame, of exactly ``raw_sizes[i]`` bytes. Tensors of one
            call may be views into one shared allocation.

        Raises:
            FormatError: A frame is corrupt or does not decode to its ``raw_sizes`` entry.
            ValueError: The arguments do not match (lengths, devices, sizes).
            GpuOutOfMemoryError: The GPU ran out of memory (the file may be fine).
            GpuCodecError: nvCOMP or CUDA failed for a reason that is not the file's.
        """
        if len(frames) != len(raw_sizes):
            raise ValueError(f"{len(frames)} frames but {len(raw_sizes)} raw sizes")
        if host_frames is not None and len(host_frames) != len(frames):
            raise ValueError(f"{len(frames)} frames but {len(host_frames)} host frames")
        out: list[torch.Tensor | None] = [None] * len(frames)
        todo_index: list[int] = []
        todo: list[torch.Tensor] = []
        for i, (frame, raw_size) in enumerate(zip(frames, raw_sizes, strict=True)):
            data = _as_byte_chunk(frame, self.device, f"frame {i}")
            raw_size = int(raw_size)
            if raw_size < 0 or raw_size > self._max_raw_bytes:
                raise FormatError(f"frame {i}: raw size {raw_size} is outside 0..{self._max_raw_bytes} for {self.id}")
            if raw_size == 0:
                # Mirrors encode: empty chunks never reach nvCOMP (see EMPTY_ZSTD_FRAME).
                out[i] = torch.empty(0, dtype=torch.uint8, device=self.device)
                continue
            if data.numel() == 0:
                raise FormatError(f"frame {i} is empty but the index says it holds {raw_size} bytes")
            if host_frames is not None and len(host_frames[i]) != data.numel():
                raise ValueError(f"frame {i}: {data.numel()} bytes on the device but {len(host_frames[i])} on the host")
            todo_index.append(i)
            todo.append(data)
        if not todo:
            return out  # type: ignore[return-value]  # every slot is filled above
        wanted = [int(raw_sizes[i]) for i in todo_index]
        on_host: dict[int, str] = {}
        if self._host_codec is not None:
            host = [host_frames[i] for i in todo_index] if host_frames is not None else self._to_host(todo)
            on_host = zstd_frames_for_host(host, wanted, self._gpu_decode_max_bytes)
            for k, reason in on_host.items():
                out[todo_index[k]] = self._decode_on_host(host[k], wanted[k], todo_index[k], reason)
        gpu = [k for k in range(len(todo)) if k not in on_host]
        if gpu:
            tensors = self._decode([todo[k] for k in gpu], [wanted[k] for k in gpu], [todo_index[k] for k in gpu])
            for k, tensor in zip(gpu, tensors, strict=True):
                out[todo_index[k]] = tensor
        return out  # type: ignore[return-value]  # every slot is filled above

    def _to_host(self, frames: list[torch.Tensor]) -> list[memoryview]:
        """Host copies of device frames, to be checked before nvCOMP sees them."""
        with torch.cuda.device(self.device):
            packed = torch.cat([f.reshape(-1) for f in frames]).cpu()
        view = packed.numpy().data.cast("B")
        out, pos = [], 0
        for f in frames:
            out.append(view[pos : pos + f.numel()])
            pos += f.numel()
        return out

    def _decode_on_host(self, frame: bytes | bytearray | memoryview, raw_size: int, index: int, reason: str) -> torch.Tensor:
        """Decode one zstd frame with libzstd (which checks everything) and copy it to the device."""
        assert self._host_codec is not None
        try:
            raw = self._host_codec.decode(memoryview(frame), raw_size)
        except FormatError as exc:
            raise FormatError(f"zstd frame {index} is not one nvCOMP may decode ({reason}), and libzstd says: {exc}") from exc
        self.host_decoded += 1
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)

    def _empty_frame(self) -> torch.Tensor:
        """The frame of an empty chunk: libzstd's empty frame for zstd, no bytes otherwise."""
        if self.id == "zstd":
            return torch.tensor(list(EMPTY_ZSTD_FRAME), dtype=torch.uint8, device=self.device)
        return torch.empty(0, dtype=torch.uint8, device=self.device)

    def _encode(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        nvcomp = _import_nvcomp()
        what = (
            f"nvCOMP {self._algorithm} compressing a batch of {len(chunks)} chunks "
            f"({sum(c.numel() for c in chunks)} bytes) on {self.device}"
        )
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            codec = self._codec(stream)
            try:
                # as_arrays(list) wraps each buffer zero-copy and "keeps the sources alive as
                # long as the batch exists" (nvCOMP 6 as_arrays); _CudaBuffer says why not DLPack.
                batch = nvcomp.as_arrays([_CudaBuffer(_aligned(c)) for c in chunks])
                encoded = codec.encode(batch)
                # Indexing "waits for the work that produced this batch ... the compressed sizes
                # are read back from the device"; each entry is a 1-D byte view of exactly the
                # compressed size, which "does not own its memory ... must not outlive" the batch
                # (BatchArray.__getitem__ docstring). So the frames are copied out into PyTorch
                # memory before the batch is released.
                views = [encoded[i] for i in range(len(chunks))]
                sizes = [int(view.buffer_size) for view in views]
                frames = _pack_aligned(views, sizes, self.device)
                # The copy runs on `stream`; nvCOMP frees its buffers when `encoded` goes, so wait
                # for the copy first rather than trust how nvCOMP's allocator orders the free.
                stream.synchronize()
            except GpuCodecError:
                raise
            except _BINDING_ERRORS as exc:
                raise (_device_error(exc, what) or GpuCodecError(f"{what} failed: {exc}")) from exc
            del views, encoded, batch
        return frames

    def _decode(self, frames: list[torch.Tensor], raw_sizes: list[int], index: list[int]) -> list[torch.Tensor]:
        nvcomp = _import_nvcomp()
        what = (
            f"nvCOMP {self._algorithm} decoding a batch of {len(frames)} frames on {self.device} "
            f"(frames {index[0]}..{index[-1]} of the call)"
        )
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            codec = self._codec(stream)
            try:
                batch = nvcomp.as_arrays([_CudaBuffer(_aligned(f)) for f in frames])
                # With no decompression_config, decode "internally calls configure_decompression
                # on src", which for RAW reads each frame's size from the format itself: a header
                # field for Zstd (the frame content size), ANS, Bitcomp and Cascaded; a walk of
                # the stream for GDeflate (Codec.get_uncomp_buffer_size docstring). nvCOMP then
                # allocates exact-size outputs, so a frame whose true size disagrees with the
                # index is caught below instead of leaving stale bytes in a larger buffer. That
                # costs one stream synchronization per batch (64 MiB of raw bytes in the reader),
                # not per frame; a config built from our sizes would skip it, but then nvCOMP's
                # own sizes could no longer be checked against the index.
                # data_type "|u1": the output is bytes whatever the codec's data_type option
                # (decode's default is "|u1" too, but only "when out is omitted").
                decoded = codec.decode(batch, data_type="|u1")
                views = [decoded[i] for i in range(len(frames))]
                sizes = [int(view.buffer_size) for view in views]
                for position, (size, wanted) in enumerate(zip(sizes, raw_sizes, strict=True)):
                    if size != wanted:
                        raise FormatError(f"{self.id} frame {index[position]} decoded to {size} bytes, the index says {wanted}")
                tensors = _pack_aligned(views, sizes, self.device)
                stream.synchronize()  # as in _encode: the copy must finish before nvCOMP frees
            except GpuCodecError:
                raise
            except _BINDING_ERRORS as exc:
                # Out of memory, CUDA faults and binding mismatches are not the file's fault;
                # what nvCOMP reports about the data itself is.
                raise (_device_error(exc, what) or FormatError(f"{what}: {exc}")) from exc
            del views, decoded, batch
        return tensors


class NoneGpuCodec:
    """Bytes stored as they are: a device copy. Needs CUDA but not nvCOMP."""

    id = "none"
    max_chunk_bytes = MAX_CHUNK_BYTES["none"]

    def __init__(self, level: int | None, device: torch.device) -> None:
        self.level = None
        self.device = device

    def __repr__(self) -> str:
        return f"NoneGpuCodec(device={self.device})"

    def encode_batch(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy each chunk (any dtype, as bytes) into a frame of its own."""
        return [_as_byte_chunk(c, self.device, f"chunk {i}").clone() for i, c in enumerate(chunks)]

    def decode_batch(
        self,
        frames: Sequence[torch.Tensor],
        raw_sizes: Sequence[int],
        *,
        host_frames: Sequence[bytes | bytearray | memoryview] | None = None,
    ) -> list[torch.Tensor]:
        """Copy each frame back; a stored frame must already be its raw size (``host_frames`` unused)."""
        if len(frames) != len(raw_sizes):
            raise ValueError(f"{len(frames)} frames but {len(raw_sizes)} raw sizes")
        out = []
        for i, (frame, raw_size) in enumerate(zip(frames, raw_sizes, strict=True)):
            data = _as_byte_chunk(frame, self.device, f"frame {i}")
            if data.numel() != int(raw_size):
                raise FormatError(f"raw frame {i} holds {data.numel()} bytes, the index says {raw_size}")
            out.append(data.clone())
        return out


_instances: dict[tuple[str, int | None, int], NvcompGpuCodec | NoneGpuCodec] = {}
_instances_lock = threading.Lock()


def gpu_codec(codec_id: str, level: int | None, device: torch.device) -> NvcompGpuCodec | NoneGpuCodec:
    """The GPU implementation of ``codec_id`` on ``device`` (cached per id, level and device).

    The returned object may be shared between threads; it keeps one ``nvcomp.Codec`` per
    thread and CUDA stream.

    Args:
        codec_id: ``"zstd"``, ``"none"``, ``"ans"``, ``"bitcomp"``, ``"gdeflate"`` or ``"cascaded"``.
        level: Encoder effort where the codec has one (see :func:`_codec_options`), else None.
        device: A CUDA device; ``torch.device("cuda")`` means the current device.

    Raises:
        CodecUnavailableError: No CUDA device, nvCOMP not installed, or an unknown codec id.
        ValueError: ``device`` is not a CUDA device, or ``level`` is out of range.
    """
    if codec_id != "none" and codec_id not in _ALGORITHMS:
        known = ", ".join(["none", *_ALGORITHMS])
        raise CodecUnavailableError(f"unknown GPU codec {codec_id!r}; known codecs: {known}")
    device = torch.device(device)
    reason = unavailable_reason(codec_id)
    if reason is not None:
        if codec_id == "none":
            raise CodecUnavailableError(f"GPU codec 'none' needs a CUDA GPU, but {reason}; use the CPU codec 'none'")
        raise CodecUnavailableError(
            f"GPU codec {codec_id!r} needs a CUDA GPU and nvCOMP, but {reason}. To use the GPU, "
            f"{INSTALL_HINT}; otherwise load and save with the CPU codecs (zstd, none)"
        )
    if device.type != "cuda":
        raise ValueError(f"GPU codecs need a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    key = (codec_id, level, index)
    with _instances_lock:
        codec = _instances.get(key)
        if codec is None:
            codec = NoneGpuCodec(level, device) if codec_id == "none" else NvcompGpuCodec(codec_id, level, device)
            _instances[key] = codec
    return codec
