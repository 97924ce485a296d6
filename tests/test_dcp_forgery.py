"""Forged DCP checkpoint directories: ``.metadata`` pickles, rank files and byte items made to run
code, allocate without bound, leave the directory or pass for another checkpoint.

Every entry point that reads a DCP directory is tried on each forgery: ``read_stored_metadata``,
``dcp.load`` with ``NvcompReader``, ``dcp_report``, ``nvckpt verify`` and ``inspect``, and a save
with ``NvcompWriter`` into the directory (which reads the checkpoint it replaces). Each case checks
that no code ran (the file an evil payload would create is absent), that the Python heap stayed
small (tracemalloc's peak), and that the error is one of ours naming the file. Single process; the
2-rank mix of two checkpoints' rank files runs in ``test_dcp.py``'s 2-rank run.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.dcp import NvcompReader, NvcompWriter, StoredItem, dcp_report, layout, metadata_file, read_stored_metadata
from nvcomp_checkpoint.errors import FormatError, SizeLimitError, UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

#: What the forgeries may make the Python heap grow by (tracemalloc's peak); the gadgets reach GiBs.
HEAP_BOUND = 48 << 20


# -- checkpoints to forge from -----------------------------------------------------------------------
def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {"model": {"w": w, "tied": w, "b": torch.randn(3, generator=g)}, "extra": {"step": seed, "note": f"seed {seed}"}}


def _target() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64, 32), "tied": torch.zeros(64, 32), "b": torch.zeros(3)},
        "extra": {"step": 0, "note": ""},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ours`` and ``other`` (two checkpoints of one model, different values), ``plain`` (FileSystemWriter)."""
    root = tmp_path_factory.mktemp("dcp_forgery")
    dcp.save(_state(1), storage_writer=NvcompWriter(root / "ours"), no_dist=True)
    dcp.save(_state(2), storage_writer=NvcompWriter(root / "other"), no_dist=True)
    dcp.save(_state(1), storage_writer=dcp.FileSystemWriter(root / "plain"), no_dist=True)
    return root


def _copy(saved: Path, name: str, to: Path) -> Path:
    shutil.copytree(saved / name, to)
    return to


def _rank_file(path: Path) -> Path:
    (found,) = path.glob("*.nvcdcp")
    return found


def _our_metadata_bytes(payload: bytes) -> bytes:
    """``.metadata`` as NvcompWriter writes it around ``payload``, with a valid checksum: a forger can compute it."""
    return (
        layout.REFUSAL_PICKLE
        + struct.pack("<8sQQ", layout.RECORD_MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload))
        + payload
    )


def _unwrap(exc: BaseException) -> BaseException:
    """The exception a rank raised, out of DCP's ``CheckpointException``."""
    if isinstance(exc, CheckpointException):
        ((error, _),) = exc.failures.values()
        return error
    return exc


def _load(path: Path, **kwargs: Any) -> dict[str, Any]:
    target = _target()
    dcp.load(target, storage_reader=NvcompReader(path, **kwargs), no_dist=True)
    return target


def _nvckpt(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from nvcomp_checkpoint.cli.main import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def _bounded(fn: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """``fn()``'s exception (None if it returned) and the Python heap's peak growth while it ran."""
    tracemalloc.start()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the caller checks which
        return exc, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return None, 0


# -- forged .metadata pickles ---------------------------------------------------------------------
def _u(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _stack_global_call(module: str, name: str, arg: bytes) -> bytes:
    """Protocol 4: ``module.name(arg)`` found by STACK_GLOBAL (``arg`` pickled already)."""
    return b"\x80\x04" + _u(module) + _u(name) + b"\x93" + arg + b"\x85R."


def _global_call(proto: int, module: str, name: str, text: str) -> bytes:
    """``module.name(text)`` with the GLOBAL opcode, in pickle protocol ``proto`` (0-5)."""
    head = b"\x80" + bytes([proto]) if proto >= 2 else b""
    return head + b"c" + module.encode() + b"\n" + name.encode() + b"\n(V" + text.encode() + b"\ntR."


def _memoized_copies(n: int, times: int, callable_pickle: bytes, wrap: Callable[[bytes], bytes]) -> bytes:
    """A list of ``times`` results of calling an allowed callable on one memoized ``n``-item container."""
    items = b"(" + b"K\x01" * n + b"l\x94"  # MARK, n ints, LIST, MEMOIZE (memo 0)
    args = wrap(b"h\x00") + b"\x94"  # the call's arguments, memo 1
    call = callable_pickle + b"\x94"  # memo 2
    body = b"]\x94" + b"(" + (b"h\x02h\x01R" * times) + b"e"  # a list of the results
    return b"\x80\x04" + items + args + call + body + b"."


def _size_copies() -> bytes:
    # torch.Size(t) over one 20 000-int list, 500 times: a 6-byte step makes a 160 kB tuple.
    return _memoized_copies(20_000, 500, _u("torch") + _u("Size") + b"\x93", lambda x: x + b"\x85")


def _index_copies() -> bytes:
    # MetadataIndex("w", offset) copies offset into a torch.Size: an allowed class with huge arguments.
    md = _u("torch.distributed.checkpoint.metadata") + _u("MetadataIndex") + b"\x93"
    return _memoized_copies(20_000, 500, md, lambda x: _u("w") + x + b"\x86")


def _path_copies() -> bytes:
    # PosixPath(s, s, ... s) of one memoized 100 kB string: each call joins 1000 copies of it.
    s = "a" * 100_000
    big = b"X" + struct.pack("<I", len(s)) + s.encode() + b"\x94"  # memo 0
    args = b"(" + b"h\x00" * 1000 + b"t\x94"  # memo 1
    call = _u("pathlib") + _u("PosixPath") + b"\x93\x94"  # memo 2
    return b"\x80\x04" + big + args + call + b"](" + b"h\x02h\x01R" * 3 + b"e."


def _build_copies() -> bytes:
    # 300 BytesStorageMetadata objects whose state is one memoized 5 000-entry dict: BUILD copies it into each.
    state = b"}\x94(" + b"".join(_u(f"k{i}") + b"N" for i in range(5_000)) + b"u"  # memo 0
    cls = _u("torch.distributed.checkpoint.metadata") + _u("BytesStorageMetadata") + b"\x93\x94"  # memo 1
    one = b"h\x01)\x81h\x00b"  # NEWOBJ, then BUILD with the memoized state
    return b"\x80\x04" + state + cls + b"](" + one * 300 + b"e."


def _memo_index(index: int) -> bytes:
    # LONG_BINPUT at a far index: the C unpickler sizes (and zeroes) its memo to twice the index.
    return b"\x80\x04N" + b"r" + struct.pack("<I", index) + b"."


def _deep_lists(depth: int) -> bytes:
    return b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."


def _gadgets(sentinel: Path) -> list[tuple[str, bytes]]:
    cmd = f"touch {sentinel}"
    dcp_md = "torch.distributed.checkpoint.metadata"
    gadgets = [
        ("stack-global-dotted-os.system", _stack_global_call(dcp_md, "os.system", _u(cmd))),
        ("torch.os.system", _stack_global_call("torch", "os.system", _u(cmd))),
        (
            "torch.ones-through-an-allowed-module",
            _stack_global_call(dcp_md, "torch.ones", b"J" + struct.pack("<i", 2**26) + b"\x85"),
        ),
        ("builtins.eval", _stack_global_call("builtins", "eval", _u(f"__import__('os').system({cmd!r})"))),
        (
            "nested-stack-global",
            b"\x80\x04" + _u(dcp_md) + _u("Metadata") + b"\x93" + _u("os.system") + b"\x93" + _u(cmd) + b"\x85R.",
        ),
        ("memoized-names", b"\x80\x04" + _u(dcp_md) + b"\x94" + _u("os.system") + b"\x94h\x00h\x01\x93" + _u(cmd) + b"\x85R."),
        ("ext-registry", b"\x80\x04\x82\x01" + _u(cmd) + b"\x85R."),
        ("persistent-id", b"\x80\x04" + _u(cmd) + b"Q."),
        ("torch.Size-of-a-memoized-list-500-times", _size_copies()),
        ("MetadataIndex-of-a-memoized-offset-500-times", _index_copies()),
        ("PosixPath-joining-one-string-1000-times", _path_copies()),
        ("BUILD-of-one-memoized-state-300-times", _build_copies()),
        ("memo-index-2**25", _memo_index(2**25)),
        ("binbytes8-claims-4-GiB", b"\x80\x05\x8e" + struct.pack("<Q", 2**32) + b"ab."),
        ("binunicode8-claims-4-GiB", b"\x80\x05\x8d" + struct.pack("<Q", 2**32) + b"ab."),
        ("frame-claims-4-GiB", b"\x80\x05\x95" + struct.pack("<Q", 2**32) + b"N."),
        ("lists-nested-100000-deep", _deep_lists(100_000)),
        ("long-decimal", b"\x80\x02L" + b"9" * 100_000 + b"L\n."),
        ("truncated", _stack_global_call(dcp_md, "Metadata", b")")[:-3]),
        ("not-a-pickle", b"\x00\xffjunk"),
    ]
    gadgets += [(f"global-os.system-protocol-{p}", _global_call(p, dcp_md, "os.system", cmd)) for p in range(6)]
    gadgets += [(f"global-dotted-torch.os.system-protocol-{p}", _global_call(p, "torch", "os.system", cmd)) for p in range(6)]
    return gadgets


_GADGET_IDS = [name for name, _ in _gadgets(Path("s"))]


def _entry_points(path: Path) -> list[tuple[str, Callable[[], Any]]]:
    return [
        ("read_stored_metadata", lambda: read_stored_metadata(path)),
        ("dcp.load", lambda: _load(path)),
        ("NvcompReader(max_bytes)", lambda: _load(path, max_bytes=1 << 20)),
        ("dcp_report", lambda: dcp_report(str(path))),
    ]


def _is_ours(name: str, error: BaseException | None) -> bool:
    """A FormatError, or where DCP itself rewraps the failure of ``read_metadata`` (in a process
    without a process group, as an AssertionError holding only its message), that."""
    if name.startswith(("dcp.load", "NvcompReader")) and isinstance(error, AssertionError):
        return "global metadata read failed" in str(error)
    return isinstance(error, FormatError)


@pytest.mark.parametrize("ours", [True, False], ids=["ours", "plain-pickle"])
@pytest.mark.parametrize("gadget", _GADGET_IDS)
def test_forged_metadata_runs_no_code_allocates_little_and_is_named(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], gadget: str, ours: bool
) -> None:
    sentinel = tmp_path / "pwned"
    payload = dict(_gadgets(sentinel))[gadget]
    ckpt = _copy(saved, "ours", tmp_path / "ckpt")
    where = ckpt / ".metadata"
    where.write_bytes(_our_metadata_bytes(payload) if ours else payload)
    for name, call in _entry_points(ckpt):
        error, peak = _bounded(call)
        error = _unwrap(error) if error is not None else None
        assert _is_ours(name, error), f"{name}: {type(error).__name__}: {error}"
        assert str(where) in str(error) and len(str(error)) < 1200, f"{name}: {error}"
        assert peak < HEAP_BOUND, f"{name}: the heap grew by {peak >> 20} MiB"
        assert not sentinel.exists(), f"{name} ran the payload"
    for command in ("verify", "inspect"):
        code, out = _nvckpt(capsys, command, str(ckpt))
        assert code != 0 and ".metadata" in out, out
        assert not sentinel.exists(), f"nvckpt {command} ran the payload"
    # A save into the directory reads the checkpoint it replaces (to remove its files afterwards).
    error, _ = _bounded(lambda: dcp.save(_state(3), storage_writer=NvcompWriter(ckpt), no_dist=True))
    assert error is None and not sentinel.exists()
    assert torch.equal(_load(ckpt)["model"]["b"], _state(3)["model"]["b"])


def test_truncated_and_bit_flipped_metadata_is_refused_naming_the_file(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, "ours", tmp_path / "ckpt")
    where = ckpt / ".metadata"
    good = where.read_bytes()
    tries = 0
    for cut in sorted({0, 1, 2, 10, len(layout.REFUSAL_PICKLE), len(layout.REFUSAL_PICKLE) + 12, len(good) // 2, len(good) - 1}):
        where.write_bytes(good[:cut])
        with pytest.raises(FormatError) as info:
            read_stored_metadata(ckpt)
        assert str(where) in str(info.value)
        tries += 1
    for pos in range(0, len(good), max(1, len(good) // 97)):
        data = bytearray(good)
        data[pos] ^= 0x20
        where.write_bytes(bytes(data))
        try:
            read_stored_metadata(ckpt)
        except FormatError as exc:
            assert str(where) in str(exc), exc
            tries += 1
            continue
        # A flip the record does not cover (the refusal pickle's message text) still reads the same.
        assert pos < len(layout.REFUSAL_PICKLE), pos
    assert tries > 90


# -- the allow-list -----------------------------------------------------------------------------------
def test_allow_list_is_exactly_what_dcp_pickles() -> None:
    assert layout._ALLOWED_GLOBALS == frozenset(
        {
            ("torch.distributed.checkpoint.metadata", "Metadata"),
            ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
            ("torch.distributed.checkpoint.metadata", "StorageMeta"),
            ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
            ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
            ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
            ("torch.distributed.checkpoint.metadata", "TensorProperties"),
            ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
            ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
            ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("nvcomp_checkpoint.dcp.layout", "StoredItem"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("torch._utils", "_get_layout"),
            ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "PureWindowsPath"),
        }
    )


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_kind_of_dcp_metadata_reads_back(protocol: int) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    props = [TensorProperties(dtype=d) for d in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.bool)]
    props.append(TensorProperties(dtype=torch.float16, memory_format=torch.channels_last))
    sdm: dict[str, Any] = {
        f"t{i}": TensorStorageMetadata(
            p,
            torch.Size([4, 6]),
            [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
                ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6])),
            ],
        )
        for i, p in enumerate(props)
    }
    sdm["obj"] = BytesStorageMetadata()
    storage = {MetadataIndex(f"t{i}", [0, 0], 0): StoredItem("__0_ab.nvcdcp", f"t{i}", 7) for i in range(len(props))}
    storage[MetadataIndex("obj")] = StoredItem("__0_ab.nvcdcp", "bytes:obj")
    storage[MetadataIndex("plain", [2, 0])] = _StorageInfo("__0_0.distcp", 0, 10, ("zstd",))
    for checkpoint_id in (Path("/ckpt/step_1"), "s3://bucket/step_1", None):
        md = Metadata(sdm, {"obj": ("obj",)}, storage, StorageMeta(checkpoint_id, "save", None, ["m"]), "1.0.0")
        back = layout.safe_unpickle(pickle.dumps(md, protocol=protocol), "x/.metadata")
        assert back == md


# -- rank files named by the metadata -----------------------------------------------------------------
def _rewrite_storage(ckpt: Path, change: Callable[[StoredItem], StoredItem]) -> None:
    md = metadata_file.decode_metadata((ckpt / ".metadata").read_bytes(), "x")
    md.storage_data = {k: change(v) for k, v in md.storage_data.items()}
    (ckpt / ".metadata").write_bytes(metadata_file.encode_metadata(md))


@pytest.mark.parametrize(
    "name",
    ["../other/{f}", "/abs/{f}", "sub/{f}", "..\\other\\{f}", "", ".", "..", "{f}\x00.txt", "C:{f}"],
    ids=["dotdot", "absolute", "subdir", "backslash", "empty", "dot", "dotdot-alone", "nul", "drive"],
)
def test_a_rank_file_name_that_leaves_the_directory_is_refused(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    ckpt = _copy(saved, "ours", tmp_path / "ckpt")
    _copy(saved, "other", tmp_path / "other")
    outside = _rank_file(tmp_path / "other").name
    _rewrite_storage(ckpt, lambda v: dataclasses.replace(v, file=name.format(f=outside)))
    for entry, call in _entry_points(ckpt):
        error, _ = _bounded(call)
        error = _unwrap(error) if error is not None else None
        assert _is_ours(entry, error) and str(ckpt / ".metadata") in str(error), f"{entry}: {error!r}"
    code, out = _nvckpt(capsys, "verify", str(ckpt))
    assert code == 1 and "outside" not in out and ".metadata" in out, out


def test_a_plain_checkpoint_whose_record_leaves_the_directory_is_refused(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, "plain", tmp_path / "plain")
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    md.storage_data = {k: dataclasses.replace(v, relative_path="../" + v.relative_path) for k, v in md.storage_data.items()}
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointException) as info:
        _load(ckpt)
    error = _unwrap(info.value)
    assert _is_ours("dcp.load", error) and "../__0_0.distcp" in str(error) and str(ckpt / ".metadata") in str(error)
    with pytest.raises(FormatError, match="__0_0.distcp"):
        read_stored_metadata(ckpt)


def test_a_rank_file_of_another_checkpoint_under_the_expected_name_is_refused(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _copy(saved, "ours", tmp_path / "ckpt")
    mine = _rank_file(ckpt)
    shutil.copyfile(_rank_file(saved / "other"), mine)  # valid in itself: every checksum holds
    with pytest.raises(CheckpointException) as info:
        _load(ckpt)
    error = _unwrap(info.value)
    assert isinstance(error, FormatError) and str(mine) in str(error), error
    code, out = _nvckpt(capsys, "verify", str(ckpt))
    assert code == 1 and mine.name in out and "another" in out, out
    with pytest.raises(FormatError, match=mine.name):
        dcp_report(str(ckpt))


def test_metadata_without_rank_file_digests_still_loads(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Checkpoints written before the digest was recorded: the field is absent from their pickles.
    ckpt = _copy(saved, "ours", tmp_path / "old")
    md = metadata_file.decode_metadata((ckpt / ".metadata").read_bytes(), "x")
    for item in md.storage_data.values():
        assert isinstance(item.index_xxh3, int)
        object.__delattr__(item, "index_xxh3")
    payload = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"index_xxh3" not in payload
    (ckpt / ".metadata").write_bytes(_our_metadata_bytes(payload))
    assert all(v.index_xxh3 is None for v in read_stored_metadata(ckpt).storage_data.values())
    got = _load(ckpt)
    assert torch.equal(got["model"]["w"], _state(1)["model"]["w"]) and got["extra"] == _state(1)["extra"]
    code, out = _nvckpt(capsys, "verify", str(ckpt))
    assert code == 0, out


def test_a_renamed_or_missing_rank_file_is_named(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _copy(saved, "ours", tmp_path / "ckpt")
    mine = _rank_file(ckpt)
    mine.rename(ckpt / "__0_renamed.nvcdcp")
    with pytest.raises(CheckpointException) as info:
        _load(ckpt)
    assert isinstance(_unwrap(info.value), FormatError) and mine.name in str(_unwrap(info.value))
    code, out = _nvckpt(capsys, "verify", str(ckpt))
    assert code == 1 and mine.name in out, out


# -- byte items (objects DCP pickles with torch.save and loads with torch.load(weights_only=False)) ----
class _Evil:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.sentinel}",))


@dataclasses.dataclass
class _Note:
    text: str


@pytest.mark.parametrize("writer", ["ours", "plain"])
def test_a_byte_item_that_would_run_code_is_refused_before_dcp_unpickles_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: str
) -> None:
    sentinel = tmp_path / "pwned"
    state = _state(1)
    state["extra"]["note"] = _Evil(str(sentinel))
    make = NvcompWriter if writer == "ours" else dcp.FileSystemWriter
    dcp.save(state, storage_writer=make(tmp_path / "ckpt"), no_dist=True)
    assert not sentinel.exists()
    with pytest.raises(CheckpointException) as info:
        _load(tmp_path / "ckpt")
    error = _unwrap(info.value)
    assert isinstance(error, UnsafeCheckpointError), repr(error)
    assert "extra.note" in str(error) and str(tmp_path / "ckpt") in str(error) and len(str(error)) < 1000, error
    assert not sentinel.exists()
    code, out = _nvckpt(capsys, "verify", str(tmp_path / "ckpt"))
    assert code == 1 and "extra.note" in out, out
    assert not sentinel.exists()


def test_a_byte_item_of_another_type_loads_when_the_caller_trusts_the_checkpoint(tmp_path: Path) -> None:
    state = _state(1)
    state["extra"]["note"] = _Note("kept")
    dcp.save(state, storage_writer=NvcompWriter(tmp_path / "ckpt"), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        _load(tmp_path / "ckpt")
    assert isinstance(_unwrap(info.value), UnsafeCheckpointError)
    assert _load(tmp_path / "ckpt", weights_only=False)["extra"]["note"] == _Note("kept")


def _rewrite_rank_file(ckpt: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Rewrite the checkpoint's rank file with ``change`` applied to its tensors, every checksum
    valid and its digest in ``.metadata`` updated: what a forger with write access can do."""
    from nvcomp_checkpoint.dcp.writer import FqnPolicy
    from nvcomp_checkpoint.writer import CheckpointWriter

    mine = _rank_file(ckpt)
    with nc.open(mine) as reader:
        stored = {k: reader.read(k) for k in reader.keys()}
    change(stored)
    with open(mine, "wb") as f:
        CheckpointWriter(f, FqnPolicy(), str(mine)).write(stored, {"dcp_rank": 0, "dcp_file": mine.name})
    with nc.open(mine) as reader:
        digest = reader.index_xxh3
    has_digest = any(f.name == "index_xxh3" for f in dataclasses.fields(StoredItem))
    _rewrite_storage(ckpt, lambda v: dataclasses.replace(v, index_xxh3=digest) if has_digest else v)
    return mine


def _torch_save_with_pickle(pkl: bytes) -> bytes:
    """A torch.save archive whose data.pkl is ``pkl``."""
    import zipfile

    buf = io.BytesIO()
    torch.save(0, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, pkl if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


@pytest.mark.parametrize(
    "pkl",
    [
        b"\x80\x02cbuiltins\nbytearray\nJ\x00\x00\x00\x40\x85R.",  # bytearray(2**30): a few bytes that commit 1 GiB
        b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R.",  # os.system("true")
        b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b".",  # lists 5000 deep
    ],
    ids=["bytearray-of-a-size", "os.system", "deep-lists"],
)
def test_a_forged_byte_item_in_a_rank_file_with_valid_checksums_is_refused(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], pkl: bytes
) -> None:
    ckpt = _copy(saved, "ours", tmp_path / "ckpt")
    forged = _torch_save_with_pickle(pkl)
    mine = _rewrite_rank_file(
        ckpt, lambda t: t.update({"bytes:extra.note": torch.frombuffer(bytearray(forged), dtype=torch.uint8)})
    )
    error, peak = _bounded(lambda: _load(ckpt))
    error = _unwrap(error) if error is not None else None
    assert isinstance(error, (FormatError, UnsafeCheckpointError)), repr(error)
    assert "extra.note" in str(error) and str(mine) in str(error), error
    assert peak < HEAP_BOUND, peak
    code, out = _nvckpt(capsys, "verify", str(ckpt))
    assert code == 1 and "extra.note" in out, out


# -- torn directories (a save killed before its commit) and size limits -------------------------------
@pytest.mark.parametrize("kind", ["ours", "plain"])
def test_a_directory_without_its_metadata_is_not_a_checkpoint(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    ckpt = _copy(saved, kind, tmp_path / "torn")
    (ckpt / ".metadata").unlink()
    for command in ("verify", "inspect"):
        code, out = _nvckpt(capsys, command, str(ckpt))
        assert code != 0 and str(ckpt) in out and ".metadata" in out and "did not finish" in out, (command, out)


def test_reader_max_bytes_refuses_before_decoding(saved: Path) -> None:
    with pytest.raises(CheckpointException) as info:
        _load(saved / "ours", max_bytes=5000)
    error = _unwrap(info.value)
    assert isinstance(error, SizeLimitError) and "max_bytes=5000" in str(error) and _rank_file(saved / "ours").name in str(error)
    with pytest.raises(CheckpointException) as info:
        _load(saved / "plain", max_bytes=5000)
    assert isinstance(_unwrap(info.value), SizeLimitError)
    # The metadata file too: read_metadata fails (DCP rewraps its error in the message).
    with pytest.raises(CheckpointException) as info:
        _load(saved / "ours", max_bytes=1000)
    assert "over max_bytes=1000" in str(_unwrap(info.value))
    with pytest.raises(SizeLimitError):
        read_stored_metadata(saved / "ours", max_bytes=1000)
    got = _load(saved / "ours", max_bytes=1 << 20)
    assert torch.equal(got["model"]["w"], _state(1)["model"]["w"])


def test_a_rank_file_whose_index_claims_other_shapes_is_refused(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A tensor far larger than the metadata's chunk, with valid checksums and digest: refused before
    # it is decoded (the slice the load wants would otherwise come out of it silently).
    ckpt = _copy(saved, "ours", tmp_path / "ckpt")
    mine = _rewrite_rank_file(ckpt, lambda t: t.update({"model.b": torch.zeros(1 << 20)}))
    with pytest.raises(CheckpointException) as info:
        _load(ckpt)
    error = _unwrap(info.value)
    assert isinstance(error, FormatError) and "model.b" in str(error) and str(mine) in str(error), error
    code, out = _nvckpt(capsys, "verify", str(ckpt))
    assert code == 1 and "model.b" in out, out


def test_converted_directories_record_rank_file_digests(saved: Path, tmp_path: Path) -> None:
    from nvcomp_checkpoint.dcp import compress_directory

    compress_directory(saved / "plain", tmp_path / "ours")
    with nc.open(_rank_file(tmp_path / "ours")) as reader:
        digest = reader.index_xxh3
    assert {v.index_xxh3 for v in read_stored_metadata(tmp_path / "ours").storage_data.values()} == {digest}
    written = read_stored_metadata(saved / "ours").storage_data.values()
    with nc.open(_rank_file(saved / "ours")) as reader:
        assert {v.index_xxh3 for v in written} == {reader.index_xxh3}


def test_a_plain_tensor_item_that_is_a_huge_view_is_refused_by_compress_and_verify(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A plain checkpoint whose "model.b" chunk is declared 2**40 elements and stored as a stride-0
    # view of one (a few hundred bytes): compressing it would write 4 TiB.
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from nvcomp_checkpoint.dcp import compress_directory

    ckpt = _copy(saved, "plain", tmp_path / "plain")
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    buf = io.BytesIO()
    torch.save(torch.zeros(1).expand(1 << 40), buf)
    (ckpt / "__9_0.distcp").write_bytes(buf.getvalue())
    md.state_dict_metadata["model.b"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([1 << 40]),
        [ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 40]))],
    )
    md.storage_data = {
        k: (_StorageInfo("__9_0.distcp", 0, len(buf.getvalue())) if k.fqn == "model.b" else v) for k, v in md.storage_data.items()
    }
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(SizeLimitError, match="model.b") as info:
        compress_directory(ckpt, tmp_path / "out")
    assert "__9_0.distcp" in str(info.value) and "4398046511104" in str(info.value)
    code, out = _nvckpt(capsys, "verify", str(ckpt))
    assert code == 1 and "model.b" in out and "4398046511104" in out, out
