"""Forged object trees (valid checksums): refused by load, keys(), verify and the CLI, fast and small.

The trees are built opcode by opcode in ``forged_files.py``: shared subtrees (a pickle "billion
laughs"), containers nested 200,000 deep, malformed ``TensorRef``s, bytes that are no pickle.
The tree rules the reader enforces are the writer's own limits, so every tree a writer saves
loads again.
"""

from __future__ import annotations

import collections
import io
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import nvcomp_checkpoint as nc
import nvcomp_checkpoint.format.skeleton as skeleton_module
from conftest import assert_tree_equal
from forged_files import FORGED_TREES, archive, deep_list, laughs, pickle2, ref, with_object_tree
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.codecs import cpu_codec
from nvcomp_checkpoint.errors import CheckpointError, FormatError, UnsupportedObjectError
from nvcomp_checkpoint.format.skeleton import MAX_TREE_DEPTH

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("valid") / "one.nvc"
    nc.save({"w": torch.arange(8.0)}, path)
    return path.read_bytes()


def _forged(directory: Path, valid: bytes, case: str) -> Path:
    path = directory / f"{case}.nvc"
    path.write_bytes(with_object_tree(valid, FORGED_TREES[case][0]))
    return path


def _nested(lists: int, leaf: Any) -> Any:
    tree = leaf
    for _ in range(lists):
        tree = [tree]
    return tree


def test_a_spliced_valid_tree_loads(tmp_path, valid):
    """The splicing helper itself keeps a file loadable: what the forged cases change is the tree only."""
    path = tmp_path / "spliced.nvc"
    path.write_bytes(with_object_tree(valid, archive(pickle2(b"}" + b"X\x01\x00\x00\x00w" + ref(0) + b"s"))))
    assert_tree_equal(nc.load(path), {"w": torch.arange(8.0)})
    assert nc.verify(path).ok


@pytest.mark.parametrize("case", list(FORGED_TREES))
def test_forged_tree_is_refused_everywhere(tmp_path, valid, case):
    path = _forged(tmp_path, valid, case)
    _, kind, words = FORGED_TREES[case]
    with pytest.raises(CheckpointError) as info:
        nc.load(path)
    assert type(info.value).__name__ == kind and words in str(info.value) and str(path) in str(info.value), str(info.value)
    with nc.open(path) as reader:
        if kind == "UnsafeCheckpointError":
            # A tree the weights-only rules refuse has no further paths to offer; the index's tensors stay listed.
            assert reader.keys() == ["w"]
        else:
            with pytest.raises(FormatError, match=re.escape(words)):
                reader.keys()
            with pytest.raises(FormatError):
                reader.read("w/again")  # a second path to a tensor is looked up in the tree
        assert torch.equal(reader.read("w"), torch.arange(8.0))  # a key of the index never unpickles
    result = nc.verify(path)
    assert not result.ok and [p.tensor for p in result.problems] == [None]
    assert type(result.problems[0].error).__name__ == kind


@pytest.mark.parametrize("case", list(FORGED_TREES))
def test_cli_verify_fails_and_decompress_refuses(tmp_path, valid, case, capsys):
    path = _forged(tmp_path, valid, case)
    assert main(["verify", str(path)]) == 1
    out, _ = capsys.readouterr()
    assert out.startswith(f"FAILED {path}"), out
    assert main(["decompress", str(path), str(tmp_path / "out.pt"), "--quiet"]) == 2  # a clear error, never 3 ("a bug")
    _, err = capsys.readouterr()
    assert "this is a bug" not in err and str(path) in err, err
    assert main(["inspect", str(path)]) == 0  # inspect reads the index only
    capsys.readouterr()


def test_verify_passes_exactly_what_load_accepts(tmp_path, valid):
    files = {case: _forged(tmp_path, valid, case) for case in FORGED_TREES}
    files["valid"] = tmp_path / "valid.nvc"
    files["valid"].write_bytes(valid)
    for case, path in files.items():
        try:
            nc.load(path)
            loads = True
        except CheckpointError:
            loads = False
        assert nc.verify(path).ok == loads == (case == "valid"), case


def test_forged_trees_fail_fast_and_small(tmp_path, valid):
    """In a child with a capped address space: every forged file fails within seconds, its memory bounded."""
    files = [_forged(tmp_path, valid, case) for case in FORGED_TREES]
    child = textwrap.dedent(
        """
        import resource, sys, time
        import nvcomp_checkpoint as nc
        from nvcomp_checkpoint.errors import CheckpointError
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
        nc.load(sys.argv[1])  # a valid file: everything a load imports is loaded before the baseline
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for path in sys.argv[2:]:
            for what, run in (("load", lambda: nc.load(path)), ("keys", lambda: nc.open(path).keys()),
                              ("verify", lambda: nc.verify(path).ok)):
                start = time.perf_counter()
                try:
                    outcome = "passed" if run() is True else "returned"
                except CheckpointError as exc:
                    outcome = type(exc).__name__
                seconds = time.perf_counter() - start
                grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024
                print(path.rsplit("/", 1)[-1], what, outcome, f"{seconds:.2f}", grown, flush=True)
        """
    )
    valid_path = tmp_path / "valid.nvc"
    valid_path.write_bytes(valid)
    proc = subprocess.run(
        [sys.executable, "-c", child, str(valid_path), *map(str, files)], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    assert len(lines) == 3 * len(files), proc.stdout
    for name, what, outcome, seconds, grown_mb in lines:
        if what == "verify" or (what == "keys" and name == "code_execution.nvc"):
            # verify reports problems ("passed" only when ok); keys() of a tree the weights-only
            # rules refuse lists the index's tensors.
            assert outcome == "returned", (name, what, outcome)
        else:
            assert outcome in ("FormatError", "UnsafeCheckpointError"), (name, what, outcome)
        # The machine is shared and noisy: the bound is a few times the second or so these take.
        assert float(seconds) < 5.0, (name, what, seconds)
        assert int(grown_mb) < 300, (name, what, grown_mb)
    print(proc.stdout)


# -- the writer's limits are the reader's ------------------------------------------------------


def test_a_tree_as_deep_as_allowed_round_trips(tmp_path):
    tree = {"deep": _nested(MAX_TREE_DEPTH - 1, torch.ones(2)), "w": torch.zeros(3)}  # the dict, then the lists
    path = tmp_path / "deep.nvc"
    nc.save(tree, path)
    assert_tree_equal(nc.load(path), tree)
    with nc.open(path) as reader:
        assert sorted(reader.keys()) == ["deep/" + "/".join(["0"] * (MAX_TREE_DEPTH - 1)), "w"]
    assert nc.verify(path).ok


def test_a_deeper_tree_is_refused_by_save(tmp_path):
    path = tmp_path / "deeper.nvc"
    with pytest.raises(UnsupportedObjectError, match=f"more than {MAX_TREE_DEPTH} deep"):
        nc.save({"deep": _nested(MAX_TREE_DEPTH, torch.ones(2))}, path)  # one container more
    with pytest.raises(UnsupportedObjectError, match="deep"):
        nc.save(_nested(100_000, 1), path)  # no RecursionError, however deep
    assert not path.exists()


def test_the_node_cap_holds_for_save_and_load(tmp_path, monkeypatch):
    path = tmp_path / "wide.nvc"
    tree = {"w": torch.ones(2), "ints": list(range(3000))}
    nc.save(tree, path)
    monkeypatch.setattr(skeleton_module, "MAX_TREE_NODES", 1000)
    with pytest.raises(UnsupportedObjectError, match="more than 1000 items"):
        nc.save(tree, tmp_path / "other.nvc")
    with pytest.raises(FormatError, match="more than 1000 items"):
        nc.load(path)
    with pytest.raises(FormatError, match="more than 1000 items"):
        nc.open(path).keys()
    assert not nc.verify(path).ok


def test_shared_and_empty_containers_of_a_users_tree_still_load(tmp_path):
    shared = {"lr": 0.1, "betas": (0.9, 0.99)}
    t = torch.randn(4)
    tree = {
        "a": shared,
        "b": shared,
        "c": [(), (), [], {}],
        "t": t,
        "tied": [t, t],
        "nt": torch.Size([2, 3]),
        "bytes": b"\x00\xff" * 3,
        "bytearray": bytearray(b"xy"),
        "set": {1, 2},
        "complex": 1 + 2j,
    }
    path = tmp_path / "shared.nvc"
    nc.save(tree, path)
    loaded = nc.load(path)
    assert_tree_equal(loaded, tree)
    assert loaded["tied"][0] is loaded["tied"][1] is loaded["t"]
    with nc.open(path) as reader:
        assert sorted(reader.keys()) == ["t", "tied/0", "tied/1"]
    assert nc.verify(path).ok


def test_walkers_are_linear_in_a_wide_shared_tree(valid, tmp_path):
    """Twenty levels of ten-fold sharing (10**20 paths): refused at the first shared list."""
    path = tmp_path / "laughs20.nvc"
    path.write_bytes(with_object_tree(valid, archive(laughs(fan=10, depth=20))))
    with pytest.raises(FormatError, match="reaches one list twice"):
        nc.load(path)


@pytest.mark.parametrize("lists", [MAX_TREE_DEPTH + 1, MAX_TREE_DEPTH + 10, 400])
def test_a_tree_just_over_the_depth_cap_is_refused(valid, tmp_path, lists):
    """Found by the tree walk (the pickle scan leaves a margin for pickle's own tuples) or by the scan."""
    path = tmp_path / f"deep{lists}.nvc"
    path.write_bytes(with_object_tree(valid, archive(deep_list(lists))))
    for weights_only in (False, True):  # the scan runs for weights-only loads; the walk for both
        with pytest.raises(FormatError, match=r"nests containers more than \d+ deep"):
            nc.load(path, weights_only=weights_only)
    with pytest.raises(FormatError, match="deep"):
        nc.open(path).keys()


@pytest.mark.parametrize(
    "case,words",
    [("deep_tuple_key", "nests containers"), ("codec_chain", "encodes something other than a string literal")],
)
def test_plain_torch_files_are_scanned_before_torch_load(tmp_path, case, words):
    # torch.load(weights_only=True) of the first kills the interpreter (SIGSEGV) while it hashes
    # the key; the second doubles its bytes at each of 40 levels. nc.load scans the pickle first.
    # In a child, so that a regression fails one test, not the run.
    path = tmp_path / "plain.pt"
    path.write_bytes(FORGED_TREES[case][0])
    child = "import sys, nvcomp_checkpoint as nc\ntry:\n    nc.load(sys.argv[1])\nexcept nc.CheckpointError as exc:\n    print(type(exc).__name__, exc)\n"
    proc = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.startswith(f"FormatError {path}: this torch.save file is refused: its pickle {words}"), proc.stdout


@pytest.mark.parametrize("command", ["inspect", "compress"])
def test_cli_scans_plain_torch_files_before_torch_load(tmp_path, command):
    # The CLI reads plain torch.save files itself (inspect, compress): the same scan runs first.
    path = tmp_path / "plain.pt"
    path.write_bytes(FORGED_TREES["deep_tuple_key"][0])
    args = [str(path)] + ([str(tmp_path / "out.nvc")] if command == "compress" else [])
    child = "import sys\nfrom nvcomp_checkpoint.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = subprocess.run([sys.executable, "-c", child, command, *args], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode in (1, 2), (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])  # not killed by a signal
    assert "this torch.save file is refused: its pickle nests containers" in proc.stdout + proc.stderr
    assert not (tmp_path / "out.nvc").exists()


# -- tensor bytes never go through pickle -------------------------------------------------------


def _skeleton_records(path: Path) -> list[str]:
    """Names of the records of a file's object-tree archive (torch writes a tensor's bytes as one)."""
    with nc.open(path) as reader:
        frame = reader.index.skeleton
    data = path.read_bytes()[frame.offset : frame.offset + frame.size]
    if not frame.is_raw:
        data = bytes(cpu_codec("zstd").decode(memoryview(data), frame.raw_size))
    return zipfile.ZipFile(io.BytesIO(data)).namelist()


Pair = collections.namedtuple("Pair", "weights meta")


def test_tensors_in_named_and_nested_tuples_go_to_the_tensor_table(tmp_path):
    tree = {
        "p": Pair((torch.ones(3), [torch.zeros(2)]), {"lr": 0.1}),
        "od": collections.OrderedDict(b=(torch.arange(4),)),
        "dd": collections.defaultdict(list, a=[torch.ones(1)]),
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    path = tmp_path / "nested.nvc"
    nc.save(tree, path)
    with nc.open(path) as reader:
        assert sorted(reader.keys()) == ["dd/a/0", "od/b/0", "p/0/0", "p/0/1/0", "param"]
    assert not [n for n in _skeleton_records(path) if n.split("/")[-2:-1] == ["data"]]
    assert_tree_equal(nc.load(path, weights_only=False), tree)


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _MyTensor(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "case,words",
    [
        ("set", "'opt/s' holds a tensor inside a set"),
        ("frozenset", "'opt/s' holds a tensor inside a frozenset"),
        ("object", "holds a tensor (torch.Tensor) inside an object"),
        ("subclass", "tensor 'opt/s' is a _MyTensor"),
        ("storage", "'opt/s' is a tensor storage"),
        ("storage_in_object", "holds a tensor storage inside an object"),
    ],
)
def test_save_refuses_tensor_bytes_the_object_tree_would_pickle(tmp_path, case, words):
    """A tensor where the writer does not look for one (a set, an object, a subclass, a bare
    storage) would be pickled into the tree; refused with its path, so every saved file loads."""
    t = torch.ones(3)
    value = {
        "set": lambda: {t},
        "frozenset": lambda: frozenset([t]),
        "object": lambda: _Holder(t),
        "subclass": lambda: t.as_subclass(_MyTensor),
        "storage": lambda: t.untyped_storage(),
        "storage_in_object": lambda: _Holder(t.untyped_storage()),
    }[case]()
    path = tmp_path / f"{case}.nvc"
    with pytest.raises(UnsupportedObjectError) as info:
        nc.save({"w": torch.zeros(2), "opt": {"s": value}}, path)
    assert words in str(info.value) and str(path) in str(info.value), str(info.value)
    assert len(str(info.value)) < 500
    assert not path.exists()


def test_a_torch_saved_stride0_view_is_refused_before_it_is_built(tmp_path, valid):
    """The view of 2**40 elements never reaches the caller: load, keys and verify name its path."""
    path = tmp_path / "view.nvc"
    path.write_bytes(with_object_tree(valid, FORGED_TREES["stride0_view"][0]))
    for weights_only in (True, False):
        with pytest.raises(FormatError, match=r"object tree holds tensor data at 'opt/0/big' \(") as info:
            nc.load(path, weights_only=weights_only)
        assert str(path) in str(info.value) and len(str(info.value)) < 500
    with pytest.raises(FormatError, match="tensor data at 'opt/0/big'"):
        nc.open(path).keys()
    result = nc.verify(path)
    assert not result.ok and isinstance(result.problems[0].error, FormatError)
