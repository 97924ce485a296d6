"""Damaged, truncated, foreign and forged files: always a clear ``CheckpointError``.

Never another exception, a crash, a hang, or an allocation of what a forged header claims.
Cases found by the fuzzers below are kept as explicit regression tests at the end.
"""

from __future__ import annotations

import copy
import errno
import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import forged_files as forged
import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import CheckpointError, CheckpointNotFoundError, ChecksumError, FormatError, UnsafeCheckpointError
from nvcomp_checkpoint.format.layout import GUARD

FOOTER = struct.Struct("<QQQ8s")


def _tree() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            # Compressible: byte planes + zstd frames; two chunks, the last one partial.
            "w": (torch.arange(700) % 11 * 0.125).to(torch.bfloat16).reshape(35, 20),
            "noise": torch.randn(100, generator=g),  # planes that do not shrink are stored raw
        },
        "optimizer": {"state": {0: {"exp_avg": (torch.arange(300) % 5).float(), "step": torch.tensor(3.0)}}},
        "epoch": 2,
    }


POLICY = nc.CodecPolicy.uniform(nc.CodecSpec(chunk_bytes=1024), min_compress_bytes=0)


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Path, bytes, dict[str, Any]]:
    path = tmp_path_factory.mktemp("valid") / "valid.nvc"
    tree = _tree()
    nc.save(tree, path, POLICY)
    return path, path.read_bytes(), tree


def _fresh(directory: Path, name: str, data: bytes) -> Path:
    """Writes ``data`` to a new file: rewriting one file in place makes ext4 flush on every
    truncate, which turns thousands of small writes into seconds."""
    path = directory / name
    if path.exists():
        path.unlink()
    path.write_bytes(data)
    return path


def _load_error(path: Path, **kwargs: Any) -> CheckpointError:
    """The error loading ``path`` raises; fails the test on success or on any other exception."""
    try:
        nc.load(path, **kwargs)
    except CheckpointError as exc:
        return exc
    pytest.fail(f"{path} loaded without an error")


def _regions(path: Path, data: bytes) -> list[tuple[int, int, str, Any]]:
    """``(start, end, kind, detail)`` covering every byte of a valid file."""
    index_offset, index_size, _, _ = FOOTER.unpack(data[-FOOTER.size :])
    g = len(GUARD) if data.startswith(GUARD) else 0  # files written before the guard start with the magic
    out: list[tuple[int, int, str, Any]] = [(0, g, "guard", None)] if g else []
    out += [(g, g + 6, "magic", None), (g + 6, g + 8, "version", None)]
    with nc.open(path) as reader:
        sk = reader.index.skeleton
        out.append((sk.offset, sk.offset + sk.size, "skeleton", None))
        for entry in reader.index.tensors:
            for ci, (_, _, frames) in enumerate(entry.chunks()):
                for p, f in enumerate(frames):
                    out.append((f.offset, f.offset + f.size, "frame", (entry.key, ci, p, len(frames))))
    out.append((index_offset, index_offset + index_size, "index", None))
    end = len(data)
    out += [
        (end - 32, end - 16, "footer-place", None),
        (end - 16, end - 8, "footer-hash", None),
        (end - 8, end, "footer-magic", None),
    ]
    return sorted(out)


# -- flipped bytes -------------------------------------------------------------------------------


def test_regions_tile_the_file(valid):
    path, data, _ = valid
    regions = _regions(path, data)
    assert regions[0][0] == 0 and regions[-1][1] == len(data)
    for (_, end, *_), (start, *_) in zip(regions, regions[1:]):
        assert end == start  # no byte of the file is outside a checked region


def test_flipped_byte_anywhere_is_detected(valid, tmp_path):
    """Exhaustive: one flipped bit at every byte position of the file."""
    path, data, tree = valid
    assert len(data) < 4000
    for start, end, kind, detail in _regions(path, data):
        for pos in range(start, end):
            mutated = bytearray(data)
            mutated[pos] ^= 1 << (pos % 8)
            damaged = _fresh(tmp_path, "damaged.nvc", mutated)
            err = _load_error(damaged)
            msg = str(err)
            assert str(damaged) in msg, msg
            if kind == "frame":
                key, chunk, plane, planes = detail
                assert isinstance(err, ChecksumError), (pos, msg)
                assert f"tensor {key!r}, chunk {chunk}" in msg and "restore" in msg, msg
                if planes > 1:
                    assert f"byte plane {plane}" in msg, msg
            elif kind in ("skeleton", "index", "footer-hash"):
                assert isinstance(err, ChecksumError), (pos, kind, msg)
                assert ("object tree" if kind == "skeleton" else "index") in msg
            elif kind in ("guard", "magic"):
                assert type(err) is FormatError and "header is damaged" in msg, msg
            elif kind == "version":
                assert type(err) is FormatError and ("damaged header" in msg or "format version" in msg), msg
            else:  # footer place / magic
                assert type(err) is FormatError and ("footer" in msg), (pos, msg)


def test_damage_is_local_to_one_tensor(valid, tmp_path):
    path, data, tree = valid
    with nc.open(path) as reader:
        frame = reader.entry("model/noise").frames[-1]
    mutated = bytearray(data)
    mutated[frame.offset + frame.size // 2] ^= 0xFF
    damaged = tmp_path / "one_bad_tensor.nvc"
    damaged.write_bytes(mutated)
    with nc.open(damaged) as reader:
        results = {entry.key: err for entry, err in reader.verify()}
        assert isinstance(results.pop("model/noise"), ChecksumError)
        assert all(err is None for err in results.values())
        # Undamaged tensors still read, bit-exact.
        assert_tree_equal(tree["model"]["w"], reader.read("model/w"))
        with pytest.raises(ChecksumError, match="model/noise"):
            reader.read("model/noise")


# -- truncation ----------------------------------------------------------------------------------


def test_truncated_at_every_length(valid, tmp_path):
    _, data, _ = valid
    for n in range(len(data)):
        cut = _fresh(tmp_path, "cut.nvc", data[:n])
        err = _load_error(cut)
        assert type(err) is FormatError, (n, err)
        assert "truncated" in str(err) or (n == 0 and "empty" in str(err)), (n, str(err))
        if n >= 8:
            with pytest.raises(FormatError, match="truncated"):
                nc.open(cut)


def test_appended_bytes_are_detected(valid, tmp_path):
    _, data, _ = valid
    longer = tmp_path / "longer.nvc"
    longer.write_bytes(data + b"\x00" * 7)
    assert "footer" in str(_load_error(longer))


# -- foreign files -------------------------------------------------------------------------------


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("readme.txt", "not a checkpoint")
    return buf.getvalue()


def _safetensors_bytes(tmp_path: Path) -> bytes:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
    return (tmp_path / "model.safetensors").read_bytes()


FOREIGN: dict[str, Callable[[Path], bytes]] = {
    "empty": lambda _: b"",
    "png": lambda _: b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4,
    "zip": lambda _: _zip_bytes(),
    "random": lambda _: bytes(__import__("random").Random(7).randbytes(5000)),
    "text": lambda _: b"epoch: 3\nloss: 0.25\n" * 20,
    "pickle_not_torch": lambda _: __import__("pickle").dumps({"a": 1}, protocol=4),
    "magic_then_garbage": lambda _: b"NVCKPT\x01\x00" + b"\xab" * 300,
    "safetensors": _safetensors_bytes,
}


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_foreign_file(tmp_path, kind):
    path = tmp_path / f"{kind}.bin"
    path.write_bytes(FOREIGN[kind](tmp_path))
    err = _load_error(path)
    assert type(err) is FormatError, err
    assert str(path) in str(err) and len(str(err)) < 500, str(err)
    assert not isinstance(err, UnsafeCheckpointError)
    if kind != "magic_then_garbage":
        assert not nc.is_nvcomp_checkpoint(path)
    with pytest.raises(FormatError):
        nc.open(path)


def test_missing_file_and_directory(tmp_path):
    for call in (nc.load, nc.open):
        # A FormatError as before, and a FileNotFoundError as torch.load's: both except clauses work.
        with pytest.raises(FormatError, match="missing.nvc: no such checkpoint file") as info:
            call(tmp_path / "missing.nvc")
        assert isinstance(info.value, FileNotFoundError) and info.value.errno == errno.ENOENT
        assert type(info.value) is CheckpointNotFoundError
        with pytest.raises(FileNotFoundError, match="no such checkpoint file"):  # a parent missing too
            call(tmp_path / "fresh" / "missing.nvc")
    with pytest.raises(FormatError, match="directory") as info:
        nc.load(tmp_path)
    assert not isinstance(info.value, FileNotFoundError)
    assert not nc.is_nvcomp_checkpoint(tmp_path / "missing.nvc")
    err = pickle.loads(pickle.dumps(info.value))  # crosses processes (DCP gathers rank errors)
    assert str(err) == str(info.value)
    missing = pickle.loads(pickle.dumps(CheckpointNotFoundError("x.nvc: no such checkpoint file")))
    assert str(missing) == "x.nvc: no such checkpoint file" and missing.errno == errno.ENOENT


# -- forged indexes (checksums recomputed, so the parser itself is what is tested) ---------------


def _split(data: bytes) -> tuple[bytes, dict[str, Any]]:
    index_offset, index_size, _, _ = FOOTER.unpack(data[-FOOTER.size :])
    return data[:index_offset], json.loads(data[index_offset : index_offset + index_size])


def _assemble(body: bytes, index: dict[str, Any] | bytes) -> bytes:
    raw = index if isinstance(index, bytes) else json.dumps(index).encode()
    return body + raw + FOOTER.pack(len(body), len(raw), xxhash.xxh3_64_intdigest(raw), b"NVCKEND\x00")


def _entry(index: dict[str, Any], key: str) -> dict[str, Any]:
    return next(t for t in index["tensors"] if t["key"] == key)


def _set(key: str, field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(index: dict[str, Any]) -> None:
        _entry(index, key)[field] = value

    return mutate


def _set_frame(key: str, i: int, j: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(index: dict[str, Any]) -> None:
        _entry(index, key)["frames"][i][j] = value

    return mutate


def _overlap(index: dict[str, Any]) -> None:
    # Two tensors of one size share their stored bytes: each frame is consistent on its own.
    a, b = _entry(index, "model/noise"), _entry(index, "optimizer/state/0/exp_avg")
    b["frames"] = copy.deepcopy(a["frames"][: len(b["frames"])])


def _skeleton_claims(raw_size: int) -> Callable[[dict[str, Any]], None]:
    def mutate(index: dict[str, Any]) -> None:
        index["skeleton"][2] = raw_size

    return mutate


FORGED: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "huge_shape": (_set("model/w", "shape", [1 << 40]), "needs"),
    "huge_2d_shape": (_set("model/w", "shape", [1 << 62, 1 << 62]), "needs"),
    "int64_overflow_with_zero_dim": (_set("model/w", "shape", [0, 1 << 64]), "impossible dimension"),
    "negative_dim": (_set("model/w", "shape", [-1, 700]), "impossible dimension"),
    "frame_beyond_eof": (_set_frame("model/w", 0, 0, 1 << 50), "outside the data region"),
    "frame_into_index": (_set_frame("model/w", 0, 1, 1 << 20), "outside the data region"),
    "frame_negative_size": (_set_frame("model/w", 0, 1, -5), "outside the data region"),
    "frame_before_data": (_set_frame("model/w", 0, 0, 2), "outside the data region"),
    "frame_record_dict": (_set_frame("model/w", 0, 0, {"offset": 8}), "malformed frame record"),
    "frames_missing": (_set("model/w", "frames", []), "frames"),
    "overlapping_frames": (_overlap, "overlap"),
    "skeleton_claims_1gib": (_skeleton_claims(1 << 30), "does not decode"),
    "skeleton_over_cap": (_skeleton_claims((1 << 30) + 1), "skeleton frame"),
    "chunk_over_cap": (_set("model/w", "chunk_bytes", 128 << 20), "chunk size"),
    "chunk_zero": (_set("model/w", "chunk_bytes", 0), "chunk size"),
    "unknown_dtype": (_set("model/w", "dtype", "float128"), "unknown dtype"),
    "unknown_codec": (_set("model/w", "codec", {"id": "lzma"}), "unknown codec"),
    "invalid_device": (_set("model/w", "device", "warp-drive:0"), "invalid device"),
    "meta_device": (_set("model/w", "device", "meta"), "meta device"),
    "entry_not_object": (lambda index: index["tensors"].__setitem__(0, None), "malformed tensor entry"),
    "newer_version": (lambda index: index.__setitem__("version", 5), "Upgrade"),
    "not_json": (lambda index: b"\xff\xfe not json", "not valid JSON"),
    "json_nesting_bomb": (lambda index: b"[" * 200_000, "not valid JSON"),
    "json_array": (lambda index: b"[1, 2]", "not an nvcomp-checkpoint index"),
    # Was: OverflowError "cannot convert float infinity to integer" (found by the fuzzer).
    "infinity_offset": (
        lambda index: json.dumps(index).replace('"frames": [[', '"frames": [[Infinity, ', 1).encode(),
        "not valid JSON",
    ),
    "nan_shape": (lambda index: json.dumps(index).replace('"shape": [', '"shape": [NaN, ', 1).encode(), "not valid JSON"),
}


@contextmanager
def _peak_allocation(limit_bytes: int) -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit_bytes, f"allocated {peak} bytes"


def _forge(data: bytes, mutate: Callable[[dict[str, Any]], Any]) -> bytes:
    body, index = _split(data)
    replaced = mutate(index)
    return _assemble(body, replaced if replaced is not None else index)


@pytest.mark.parametrize("case", list(FORGED))
def test_forged_index(valid, tmp_path, case):
    _, data, _ = valid
    mutate, fragment = FORGED[case]
    forged = tmp_path / f"{case}.nvc"
    forged.write_bytes(_forge(data, mutate))
    with _peak_allocation(8 << 20):
        err = _load_error(forged)
    assert isinstance(err, FormatError), err
    assert fragment in str(err) and str(forged) in str(err), str(err)


FOOTER_FORGERIES = {
    "index_size_2_60": lambda off, size: (off, 1 << 60),
    "index_size_max_u64": lambda off, size: (off, (1 << 64) - 1),
    "index_offset_beyond_eof": lambda off, size: (1 << 63, size),
    "index_offset_zero": lambda off, size: (0, size),
    "index_just_under_cap": lambda off, size: (off, (1 << 30) - 1),
}


@pytest.mark.parametrize("case", list(FOOTER_FORGERIES))
def test_forged_footer(valid, tmp_path, case):
    _, data, _ = valid
    off, size, digest, magic = FOOTER.unpack(data[-FOOTER.size :])
    new_off, new_size = FOOTER_FORGERIES[case](off, size)
    forged = tmp_path / f"{case}.nvc"
    forged.write_bytes(data[: -FOOTER.size] + FOOTER.pack(new_off, new_size, digest, magic))
    with _peak_allocation(1 << 20):
        err = _load_error(forged)
    assert type(err) is FormatError and "impossible" in str(err), str(err)


def _consistent_huge_claim(data: bytes) -> bytes:
    """An index whose 16 GiB tensor is consistent with the file: 256 tiny frames of 64 MiB each."""
    body, index = _split(data)
    frames = []
    junk = b"\x28\xb5\x2f\xfd" * 2  # zstd magic, then nothing a decoder accepts
    for i in range(256):
        frames.append([len(body) + len(junk) * i, len(junk), f"{xxhash.xxh3_64_intdigest(junk):016x}"])
    body += junk * 256
    entry = _entry(index, "model/w")
    entry.update(dtype="uint8", shape=[1 << 34], filter="none", width=1, chunk_bytes=64 << 20, frames=frames)
    return _assemble(body, index)


def test_absurd_claims_under_address_space_limit(valid, tmp_path):
    """In a child whose address space is capped, forged files fail cleanly, without MemoryError."""
    _, data, _ = valid
    files = []
    for case in ("huge_shape", "skeleton_claims_1gib", "huge_2d_shape"):
        files.append(tmp_path / f"{case}.nvc")
        files[-1].write_bytes(_forge(data, FORGED[case][0]))
    files.append(tmp_path / "consistent_16gib.nvc")
    files[-1].write_bytes(_consistent_huge_claim(data))
    child = textwrap.dedent(
        """
        import resource, sys
        import nvcomp_checkpoint as nc
        from nvcomp_checkpoint.errors import CheckpointError
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (768 << 20), resource.RLIM_INFINITY))
        for path in sys.argv[1:]:
            try:
                nc.load(path)
                print(path, "LOADED")
            except CheckpointError as exc:
                print(path, type(exc).__name__, str(exc).replace("\\n", " ")[:200])
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(files), proc.stdout + proc.stderr[-2000:]
    for line in lines:
        assert "LOADED" not in line
    assert "FormatError" in lines[0] and "needs" in lines[0]
    assert "does not decode" in lines[1]
    # The consistent claim either cannot be allocated (a clear CheckpointError) or, where the
    # OS lends the address space, fails at its first junk frame.
    assert "16GiB" not in lines[3] and ("cannot be allocated" in lines[3] or "does not decode" in lines[3]), lines[3]


# -- fuzzing -------------------------------------------------------------------------------------


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def on_alarm(*_: Any) -> None:
        raise TimeoutError(f"reader hung for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _exercise(path: Path) -> Any:
    """Everything a user does with a file; returns the loaded tree."""
    tree = nc.load(path)
    with nc.open(path) as reader:
        for key in reader.keys():
            reader.read(key)
        for _entry_, err in reader.verify():
            if err is not None:
                raise err
        reader.summary()
    return tree


_mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 64)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
)


def _apply(data: bytes, mutations: list[tuple[str, int, Any]]) -> bytes:
    out = bytearray(data)
    for op, pos, arg in mutations:
        pos = pos % (len(out) + 1)
        if op == "set" and pos < len(out):
            out[pos] = arg
        elif op == "insert":
            out[pos:pos] = arg
        elif op == "delete":
            del out[pos : pos + arg]
        elif op == "truncate":
            del out[pos:]
    return bytes(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_byte_mutations(valid, tmp_path, mutations):
    """Any change to the bytes of a valid file is detected: every byte is covered by a check."""
    _, data, tree = valid
    mutated = _apply(data, mutations)
    path = _fresh(tmp_path, "fuzz.nvc", mutated)
    with _time_limit(30):
        try:
            loaded = _exercise(path)
        except CheckpointError:
            return
    assert mutated == data, "a changed file loaded without an error"
    assert_tree_equal(tree, loaded)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "cuda:0",
            "cpu",
            "xpu",
            "meta",
            "float8_e5m2",
            "complex128",
            "qint8",
            "zstd",
            "ans",
            "none",
            "byteplane",
            "ffffffffffffffff",
        ]
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _leaf_paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _leaf_paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _leaf_paths(v, path + (i,))
    return out


def _replace_at(root: Any, where: tuple[Any, ...], value: Any) -> None:
    """Sets ``root[where...] = value`` if that path still exists (earlier edits may remove it)."""
    node = root
    for part in where[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return
    last = where[-1]
    if (isinstance(node, dict) and last in node) or (isinstance(node, list) and isinstance(last, int) and last < len(node)):
        node[last] = value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_forged_index(valid, tmp_path, data):
    """Index fields replaced by arbitrary JSON, checksum recomputed: success or CheckpointError."""
    _, raw, _ = valid
    body, index = _split(raw)
    paths = _leaf_paths(index)
    for _ in range(data.draw(st.integers(1, 3))):
        _replace_at(index, data.draw(st.sampled_from(paths)), data.draw(_json_values))
    path = _fresh(tmp_path, "forged.nvc", _assemble(body, index))
    with _time_limit(30), _peak_allocation(256 << 20):
        try:
            _exercise(path)
        except CheckpointError:
            pass


# -- fuzzing the object tree: a grammar of pickles ------------------------------------------------
#
# Each strategy gives the opcodes that push one value, so that any composition is a pickle. The
# shapes that broke readers are productions of the grammar: one value referenced many times
# through the memo (shared subtrees, cycles), containers nested thousands deep (lists, dicts,
# tuples, and tuples as dict keys), TensorRef of anything, a bytearray built from a size, globals
# the weights-only rules refuse; and the bytes may be cut anywhere.

_leaf_ops = st.one_of(
    st.integers(-(2**31), 2**31 - 1).map(forged.int_op),
    st.text(max_size=8).map(forged.str_op),
    st.sampled_from(
        [forged.NONE, forged.NEWTRUE, forged.EMPTY_LIST, forged.EMPTY_DICT, forged.EMPTY_TUPLE, b"G" + struct.pack(">d", 0.5)]
    ),
    # TensorRef(i) in and out of the index (of 4 tensors), and of things that are no index.
    st.integers(-2, 6).map(forged.ref),
    st.sampled_from([forged.EMPTY_LIST, forged.NONE, forged.NEWTRUE, forged.str_op("1"), forged.EMPTY_TUPLE]).map(
        lambda arg: forged.ref_with(arg + forged.TUPLE1)
    ),
    st.just(forged.ref_with(forged.EMPTY_TUPLE)),  # TensorRef() without its index
    st.sampled_from(
        [("builtins", "bytearray"), ("os", "system"), ("collections", "OrderedDict"), ("builtins", "set"), ("_codecs", "encode")]
    ).map(lambda g: forged.global_op(*g) + forged.int_op(3) + forged.TUPLE1 + forged.REDUCE),
    st.integers(0, 3).map(lambda n: forged.codec_chain(n)[2:-1]),  # bytes, then hex of hex of ... of them
    st.just(forged.device_copy_of_a_view()[2:-1]),
)


def _containers(children: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    items = st.lists(children, max_size=4)
    return st.one_of(
        items.map(lambda xs: forged.EMPTY_LIST + forged.MARK + b"".join(xs) + forged.APPENDS),
        items.map(lambda xs: forged.MARK + b"".join(xs) + forged.TUPLE),
        items.map(
            lambda xs: (
                forged.EMPTY_DICT + forged.MARK + b"".join(forged.str_op(str(i)) + x for i, x in enumerate(xs)) + forged.SETITEMS
            )
        ),
        # One value held ``fan`` times, through the memo: ``fan`` levels of this is the "billion laughs".
        st.tuples(children, st.integers(2, 10), st.integers(0, 300)).map(
            lambda a: a[0] + forged.put(a[2]) + forged.EMPTY_LIST + forged.MARK + forged.get(a[2]) * a[1] + forged.APPENDS
        ),
        # A list that holds itself.
        st.tuples(children, st.integers(0, 300)).map(
            lambda a: forged.EMPTY_LIST + forged.put(a[1]) + a[0] + forged.APPEND + forged.get(a[1]) + forged.APPEND
        ),
    )


def _deep(child: bytes, kind: str, depth: int) -> bytes:
    if kind == "list":
        return forged.EMPTY_LIST * depth + child + forged.APPEND * depth
    if kind == "tuple":
        return child + forged.TUPLE1 * depth
    if kind == "dict":
        return (forged.EMPTY_DICT + forged.str_op("k")) * depth + child + forged.SETITEM * depth
    # A dict whose key is a tuple ``depth`` deep: hashing it recursed in C until the stack broke.
    return forged.EMPTY_DICT + forged.EMPTY_TUPLE + forged.TUPLE1 * depth + child + forged.SETITEM


_tree_ops = st.recursive(_leaf_ops, _containers, max_leaves=12)
_object_tree = st.one_of(
    _tree_ops,
    st.tuples(_tree_ops, st.sampled_from(["list", "tuple", "dict", "tuple_key"]), st.integers(1, 5000)).map(lambda a: _deep(*a)),
    st.tuples(st.sampled_from(["list", "tuple_key"]), st.just(200_000)).map(lambda a: _deep(forged.ref(0), *a)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=_object_tree, cut=st.none() | st.integers(0, 10**6), raw=st.booleans())
def test_fuzz_forged_object_tree(valid, tmp_path, ops, cut, raw):
    """Object trees of any shape, checksums valid: a load, or a CheckpointError, in bounded time and memory."""
    _, data, _ = valid
    pkl = forged.pickle2(ops)
    if cut is not None:
        pkl = pkl[: cut % (len(pkl) + 1)]
    path = _fresh(tmp_path, "tree.nvc", forged.with_object_tree(data, pkl if raw else forged.archive(pkl)))
    with _time_limit(30), _peak_allocation(256 << 20):
        try:
            _exercise(path)
        except CheckpointError:
            pass
    result = nc.verify(path)
    try:
        nc.load(path)
        assert result.ok, result.problems
    except CheckpointError:
        assert not result.ok


# -- regression tests for cases the fuzzers and the exhaustive tests found --------------------


def test_regression_damaged_magic_is_not_called_unsafe(valid, tmp_path):
    # Was: UnsafeCheckpointError "holds Python objects ... load with weights_only=False", which
    # invited users to unpickle a damaged file with full pickle.
    _, data, _ = valid
    path = tmp_path / "bad_magic.nvc"
    path.write_bytes(b"X" + data[1:])
    err = _load_error(path)
    assert type(err) is FormatError and "header is damaged" in str(err)
    assert "weights_only" not in str(err)


def test_regression_reserved_header_byte(valid, tmp_path):
    # Was: "format version 1; this nvcomp-checkpoint reads version 1. Upgrade to read it."
    _, data, _ = valid
    path = tmp_path / "reserved.nvc"
    g = len(GUARD)
    path.write_bytes(data[: g + 7] + b"\x01" + data[g + 8 :])
    err = _load_error(path)
    assert "damaged header" in str(err) and "Upgrade" not in str(err)
    path.write_bytes(data[: g + 6] + b"\x09" + data[g + 7 :])
    assert "Upgrade" in str(_load_error(path))


@pytest.mark.parametrize(
    "field,value",
    [("device", "xpu:0"), ("device", "privateuseone"), ("requires_grad", True), ("parameter", True)],
)
def test_regression_index_fields_that_used_to_escape(valid, tmp_path, field, value):
    # Was: AssertionError "Torch not compiled with XPU enabled", RuntimeError "Only Tensors of
    # floating point dtype can require gradients" for an int tensor marked requires_grad.
    _, data, tree = valid
    body, index = _split(data)
    for entry in index["tensors"]:
        entry[field] = value
    if field == "parameter":
        for entry in index["tensors"]:
            entry["requires_grad"] = True
    path = tmp_path / "fields.nvc"
    path.write_bytes(_assemble(body, index))
    loaded = nc.load(path)
    assert_tree_equal(tree, loaded)
    assert loaded["model"]["w"].device.type == "cpu"


def test_regression_negative_skeleton_size(valid, tmp_path):
    # Was: ValueError "read length must be non-negative or -1".
    _, data, _ = valid
    body, index = _split(data)
    index["skeleton"][1] = -1
    path = tmp_path / "neg.nvc"
    path.write_bytes(_assemble(body, index))
    assert "skeleton frame" in str(_load_error(path))


def test_regression_zstd_frame_larger_than_index_says(valid, tmp_path):
    # A frame whose header declares more bytes than the index: refused before decoding.
    _, data, _ = valid
    body, index = _split(data)
    frame = zstandard.ZstdCompressor().compress(b"\x00" * 5000)
    entry = _entry(index, "optimizer/state/0/exp_avg")
    entry["filter"], entry["width"], entry["shape"] = "none", 4, [256]  # one 1024-byte chunk
    entry["frames"] = [[len(body), len(frame), f"{xxhash.xxh3_64_intdigest(frame):016x}"]]
    path = tmp_path / "declares.nvc"
    path.write_bytes(_assemble(body + frame, index))
    err = _load_error(path)
    assert "optimizer/state/0/exp_avg" in str(err) and "chunk 0" in str(err) and "declares 5000" in str(err)


def test_raw_frame_of_the_wrong_size_is_refused_at_open(tmp_path):
    """A `none` frame shorter than the shape needs is damage, found before any decoder runs."""
    import json

    import xxhash

    from nvcomp_checkpoint.errors import FormatError
    from nvcomp_checkpoint.format.layout import FOOTER, pack_footer

    path = tmp_path / "raw.nvc"
    nc.save({"w": torch.arange(4096, dtype=torch.float32)}, path, policy=nc.CodecPolicy.uniform("none"))
    data = bytearray(path.read_bytes())
    offset, size, _, _ = FOOTER.unpack(bytes(data[-FOOTER.size :]))
    index = json.loads(bytes(data[offset : offset + size]))
    index["tensors"][0]["frames"][0][1] -= 1
    blob = json.dumps(index, separators=(",", ":")).encode()
    forged = bytes(data[:offset]) + blob + pack_footer(offset, len(blob), xxhash.xxh3_64_intdigest(blob))
    path.write_bytes(forged)
    with pytest.raises(FormatError, match="raw frame"):
        nc.open(path)


def test_verify_reports_every_tensor_even_after_a_bad_one(tmp_path):
    path = tmp_path / "two.nvc"
    nc.save({"a": torch.randn(50_000), "b": torch.randn(50_000)}, path)
    with nc.open(path) as reader:
        first = reader.entry("a").frames[0]
    data = bytearray(path.read_bytes())
    data[first.offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with nc.open(path) as reader:
        results = {entry.key: err for entry, err in reader.verify()}
    assert set(results) == {"a", "b"}
    assert results["a"] is not None and "'a'" in str(results["a"])
    assert results["b"] is None
