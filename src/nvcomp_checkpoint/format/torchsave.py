"""Plain ``torch.save`` archives, checked before torch reads them: the pickle scan, and the bytes a
load will build (storages, views, device copies), counted without building anything.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from dataclasses import dataclass
from typing import IO, Any, Callable

import torch

from ..errors import FormatError, SizeLimitError
from .picklescan import PicklePolicy, builds_tensor, loaded_global, scan_pickle

__all__ = ["MAX_PICKLE_NESTING", "ARCHIVE_POLICY", "ArchiveBytes", "archive_pickle", "check_torch_archive", "storage_records"]

#: Nesting of containers inside a weights-only pickle, checked before torch builds anything:
#: hashing a tuple recurses in C without a guard, so a dict key of tuples nested 100,000 deep
#: crashes the interpreter. A little over the object tree's depth cap (256), for the argument
#: tuples that pickle wraps around values.
MAX_PICKLE_NESTING = 256 + 16

#: The scan of a plain torch.save file's pickle: storages (persistent ids) are what it holds.
ARCHIVE_POLICY = PicklePolicy(max_nesting=MAX_PICKLE_NESTING, persistent_ids=True)


@dataclass(frozen=True)
class ArchiveBytes:
    """What loading a torch.save archive builds, counted from its pickle.

    Attributes:
        allocated: Bytes of its storages (each once) and of the copies its pickle makes (a device copy).
        expanded: Bytes its views show beyond the storage they reach: a view whose elements overlap
            (a stride-0 view of 2**40 elements over one element shows 2**40 - 1 elements more than it
            reaches). Views that share a storage without overlapping (tied weights, slices) add nothing.
    """

    allocated: int
    expanded: int

    @property
    def needed(self) -> int:
        """What a load costs a caller that copies or re-saves its tensors (``contiguous()`` pays for every element shown)."""
        return self.allocated + self.expanded


def storage_records(names: list[str]) -> list[str]:
    """The records of a torch.save archive that hold tensor bytes (``<archive>/data/<key>``)."""
    return [name for name in names if name.rsplit("/", 2)[-2:-1] == ["data"]]


def archive_pickle(stream: IO[bytes], size: int, corrupt: str) -> tuple[bytes, str, dict[str, int]]:
    """The ``data.pkl`` record of a torch.save archive (torch reads the tree from it), the prefix of
    its records (``"archive/"``), and the size of each of its tensor storage records by name."""
    try:
        with zipfile.ZipFile(stream) as archive:
            infos = archive.infolist()
            names = [info.filename for info in infos]
            picks = [info for info in infos if info.filename.endswith("/data.pkl") or info.filename == "data.pkl"]
            if len(picks) != 1 or len(set(names)) != len(names):
                raise FormatError(f"{corrupt}: its archive holds {len(picks)} data.pkl records among {len(names)} names")
            # torch writes records uncompressed; a deflated one could expand without bound.
            if picks[0].compress_type != zipfile.ZIP_STORED or picks[0].file_size > size:
                raise FormatError(f"{corrupt}: its data.pkl record is compressed or larger than the archive")
            stored = set(storage_records(names))
            records = {info.filename: info.file_size for info in infos if info.filename in stored}
            return archive.read(picks[0]), picks[0].filename[: -len("data.pkl")], records
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError, RuntimeError, NotImplementedError) as exc:
        raise FormatError(f"{corrupt}: not a readable archive ({exc})") from exc


def check_torch_archive(stream: IO[bytes], size: int, where: str, max_bytes: int | None = None) -> ArchiveBytes:
    """Check a plain ``torch.save`` zip archive before a weights-only ``torch.load`` of it.

    Only the ``data.pkl`` record is read (tensors are separate records). Its pickle is scanned
    (:func:`~nvcomp_checkpoint.format.picklescan.scan_pickle`), then what it builds is counted:
    every storage must be the size of its record, every view must lie inside its storage, and
    no tensor or storage constructor may be called with a size (torch.save never does).

    Args:
        stream: The archive, positioned anywhere.
        size: Its size in bytes.
        where: The file, for messages.
        max_bytes: Refuse an archive whose load would build more (:attr:`ArchiveBytes.needed`).

    Raises:
        FormatError: The archive is unreadable, or its pickle is refused.
        SizeLimitError: Loading it would build more than ``max_bytes``.
    """
    refused = f"{where}: this torch.save file is refused"
    pkl, prefix, records = archive_pickle(stream, size, refused)
    scan_pickle(pkl, refused, ARCHIVE_POLICY)
    counted = _Counter(prefix, records, refused).count(pkl)
    if max_bytes is not None and counted.needed > max_bytes:
        raise SizeLimitError(
            f"{where}: loading this torch.save file builds {counted.needed} bytes (storages and copies: {counted.allocated}, "
            f"views overlapping themselves: {counted.expanded} more), over max_bytes={max_bytes}; raise it if you trust the file",
            needed=counted.needed,
            limit=max_bytes,
        )
    return counted


class _Refused(Exception):
    """Raised inside the counting unpickler; :class:`_Counter` turns it into a FormatError."""


class _Storage:
    """A storage as a persistent id declares it."""

    __slots__ = ("key", "nbytes", "itemsize")

    def __init__(self, key: str, nbytes: int, itemsize: int) -> None:
        self.key, self.nbytes, self.itemsize = key, nbytes, itemsize


class _Tensor:
    """A tensor the pickle builds: its elements and their size."""

    __slots__ = ("numel", "itemsize")

    def __init__(self, numel: int, itemsize: int) -> None:
        self.numel, self.itemsize = numel, itemsize


class _Stub:
    """Any other global: nothing of the file's runs or is allocated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _Dict(dict):
    """An OrderedDict or Counter: a dict that also takes the attributes a BUILD gives (``_metadata``)."""


class _StorageType:
    """A storage class named in a persistent id; called, it would allocate."""

    def __init__(self, name: str, itemsize: int) -> None:
        self.name, self.itemsize = name, itemsize

    def __call__(self, *args: Any) -> Any:
        raise _Refused(f"calls {self.name}, which no writer does (it allocates what its argument says)")


def _itemsize(module: str, name: str) -> int:
    """The element size of a storage class as torch.load reads it (``torch.FloatStorage``: 4)."""
    if module != "torch" or name == "UntypedStorage":
        return 1
    try:
        # How torch.load itself finds it (the classes' own ``dtype`` warns that TypedStorage is deprecated).
        return torch.storage._get_dtype_from_pickle_storage_type(name).itemsize
    except KeyError:
        return 1


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise _Refused(f"builds a tensor whose {what} is not a tuple of counts")
    return value


class _Counter:
    """Unpickles a torch.save pickle with every global replaced (rebuild functions by counters):
    what torch would build is counted, nothing is built. Runs after the scan (sizes and nesting bounded)."""

    def __init__(self, prefix: str, records: dict[str, int], refused: str) -> None:
        self.prefix, self.records, self.refused = prefix, records, refused
        self.storages: dict[str, _Storage] = {}
        self.copies = 0
        self.expanded = 0

    def count(self, pkl: bytes) -> ArchiveBytes:
        counter = self

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                return counter.global_for(module, name)

            def persistent_load(self, pid: Any) -> Any:
                return counter.storage(pid)

        try:
            Unpickler(io.BytesIO(pkl)).load()
        except _Refused as exc:
            raise FormatError(f"{self.refused}: its pickle {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything; torch would refuse it too
            raise FormatError(
                f"{self.refused}: its pickle does not describe tensors ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
        return ArchiveBytes(sum(s.nbytes for s in self.storages.values()) + self.copies, self.expanded)

    def global_for(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        counters = self._counters()
        if full in counters:
            return counters[full]
        obj = loaded_global(module, name)
        if isinstance(obj, torch.dtype):
            return obj
        if full in ("collections.OrderedDict", "collections.Counter", "builtins.dict"):
            return _Dict
        if full in ("builtins.set", "builtins.frozenset"):
            return set if name == "set" else frozenset
        if full == "torch.Size":
            return tuple
        if builds_tensor(full):
            if name.endswith("Storage"):
                return _StorageType(full, _itemsize(module, name))
            if name.startswith("_rebuild"):
                return _refusing(
                    f"calls {full}, whose size this reader does not know; if you trust the file, load it with weights_only=False"
                )
            return _refusing(f"calls {full}, which no writer does (it allocates what its argument says)")
        return type("_Stub", (_Stub,), {})

    def _counters(self) -> dict[str, Callable[..., Any]]:
        """The rebuild functions of torch.save, by name, each replaced by what counts its bytes."""
        return {
            "torch._utils._rebuild_tensor": self.view,
            "torch._utils._rebuild_tensor_v2": self.view,
            "torch._utils._rebuild_qtensor": self.view,
            "torch._utils._rebuild_tensor_v3": self.typed_view,
            "torch._utils._rebuild_parameter": self.same,
            "torch._utils._rebuild_parameter_with_state": self.same,
            "torch._tensor._rebuild_from_type_v2": lambda func, new_type, args, state=None: func(*args),
            "torch._utils._rebuild_device_tensor_from_cpu_tensor": self.device_copy,
            "torch._utils._rebuild_sparse_tensor": lambda layout, data: _Tensor(0, 1),
            "torch._utils._rebuild_nested_tensor": lambda buffer, *rest: buffer,
            "torch._utils._rebuild_meta_tensor_no_storage": lambda *args: _Tensor(0, 1),
            "torch._utils._rebuild_wrapper_subclass": lambda *args: _Tensor(0, 1),
        }

    def storage(self, pid: Any) -> _Storage:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
            raise _Refused("has a persistent id that is not a storage")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise _Refused(f"declares a storage {str(key)[:40]!r} that is malformed")
        nbytes = numel * kind.itemsize
        held = self.records.get(f"{self.prefix}data/{key}")
        if held is None:
            raise _Refused(f"refers to storage {key[:40]!r}, which its archive does not hold")
        if held != nbytes:
            raise _Refused(f"declares {nbytes} bytes for storage {key[:40]!r}; its record holds {held}")
        known = self.storages.get(key)
        if known is not None and known.nbytes != nbytes:
            raise _Refused(f"declares storage {key[:40]!r} twice, of two sizes")
        if known is None:
            known = self.storages[key] = _Storage(key, nbytes, kind.itemsize)
        return known

    def view(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
        if not isinstance(storage, _Storage):
            raise _Refused("builds a tensor from something that is not a storage")
        return self._view(storage, offset, size, stride, storage.itemsize)

    def typed_view(
        self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *rest: Any
    ) -> _Tensor:
        if not isinstance(storage, _Storage) or not isinstance(dtype, torch.dtype):
            raise _Refused("builds a tensor from something that is not a storage")
        return self._view(storage, offset, size, stride, dtype.itemsize)

    def _view(self, storage: _Storage, offset: Any, size: Any, stride: Any, itemsize: int) -> _Tensor:
        size, stride = _ints(size, "size"), _ints(stride, "stride")
        if type(offset) is not int or offset < 0 or len(size) != len(stride):
            raise _Refused("builds a tensor whose offset or strides are malformed")
        numel = math.prod(size)
        extent = 0 if numel == 0 else offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        if extent * itemsize > storage.nbytes:
            raise _Refused(
                f"builds a view (offset {offset}, size {list(size)[:8]}, stride {list(stride)[:8]}) reaching element {extent} of "
                f"{itemsize} bytes, past the end of its storage {storage.key[:40]!r} of {storage.nbytes} bytes"
            )
        self.expanded += max(0, numel - extent) * itemsize
        return _Tensor(numel, itemsize)

    def same(self, data: Any, *rest: Any) -> Any:
        return data

    def device_copy(self, data: Any, dtype: Any, *rest: Any) -> _Tensor:
        if not isinstance(data, _Tensor) or not isinstance(dtype, torch.dtype):
            raise _Refused("copies something that is not a tensor")
        self.copies += data.numel * dtype.itemsize
        return _Tensor(data.numel, dtype.itemsize)


def _refusing(why: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _Refused(why)

    return refuse
