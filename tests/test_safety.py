"""Loading never runs code from a file unless the caller opts in with ``weights_only=False``.

Malicious skeletons are written through the real writer (a tree holding an object whose
``__reduce__`` calls ``os.system``); plain ``torch.save`` files are checked the same way.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import CheckpointError, FormatError, UnsafeCheckpointError
from nvcomp_checkpoint.format.skeleton import TensorRef


class Exploit:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Harmless:
    """A plain user object (trusted files may hold such things: configs, custom states)."""

    def __init__(self, name: str, values: list[int]) -> None:
        self.name = name
        self.values = values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Harmless) and (self.name, self.values) == (other.name, other.values)


def _tree_with(obj: object) -> dict:
    return {"model": {"w": torch.arange(4096, dtype=torch.float32)}, "payload": obj, "epoch": 1}


def test_malicious_skeleton_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.nvc"
    nc.save(_tree_with(Exploit(marker)), path)
    assert nc.is_nvcomp_checkpoint(path) and not marker.exists()

    with pytest.raises(UnsafeCheckpointError) as info:
        nc.load(path)
    msg = str(info.value)
    assert str(path) in msg and "weights_only=False" in msg and "system" in msg
    with nc.open(path) as reader, pytest.raises(UnsafeCheckpointError):
        reader.load()
    assert not marker.exists()
    # Tensors stay readable one by one: they never go through pickle.
    with nc.open(path) as reader:
        assert torch.equal(reader.read("model/w"), torch.arange(4096, dtype=torch.float32))
    assert not marker.exists()


def test_unsafe_error_is_not_a_format_error(tmp_path):
    nc.save(_tree_with(Harmless("x", [1])), tmp_path / "obj.nvc")
    with pytest.raises(UnsafeCheckpointError) as info:
        nc.load(tmp_path / "obj.nvc")
    assert isinstance(info.value, CheckpointError) and not isinstance(info.value, FormatError)
    assert "Harmless" in str(info.value) and "add_safe_globals" in str(info.value)


def test_trusted_file_loads_with_weights_only_false(tmp_path):
    tree = _tree_with(Harmless("cfg", [1, 2, 3]))
    nc.save(tree, tmp_path / "trusted.nvc")
    back = nc.load(tmp_path / "trusted.nvc", weights_only=False)
    assert back["payload"] == Harmless("cfg", [1, 2, 3])
    assert_tree_equal(tree["model"], back["model"])


def test_allowlisted_type_loads_weights_only(tmp_path):
    tree = _tree_with(Harmless("cfg", [4]))
    nc.save(tree, tmp_path / "allow.nvc")
    with torch.serialization.safe_globals([Harmless]):
        back = nc.load(tmp_path / "allow.nvc")
    assert back["payload"] == Harmless("cfg", [4])
    with pytest.raises(UnsafeCheckpointError):
        nc.load(tmp_path / "allow.nvc")  # the allowance ended with the context


def test_plain_torch_save_with_exploit_does_not_run(tmp_path):
    marker = tmp_path / "pwned_plain"
    path = tmp_path / "evil.pt"
    torch.save(_tree_with(Exploit(marker)), path)
    assert not nc.is_nvcomp_checkpoint(path)
    with pytest.raises(UnsafeCheckpointError) as info:
        nc.load(path)
    assert "weights_only=False" in str(info.value) and str(path) in str(info.value)
    assert not marker.exists()


def test_plain_torch_save_trusted_object(tmp_path):
    tree = _tree_with(Harmless("plain", [7]))
    torch.save(tree, tmp_path / "plain.pt")
    with pytest.raises(UnsafeCheckpointError):
        nc.load(tmp_path / "plain.pt")
    back = nc.load(tmp_path / "plain.pt", weights_only=False)
    assert back["payload"] == Harmless("plain", [7])


def test_legacy_torch_save_format_is_checked_too(tmp_path):
    marker = tmp_path / "pwned_legacy"
    path = tmp_path / "legacy.pt"
    torch.save(_tree_with(Exploit(marker)), path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointError):
        nc.load(path)
    assert not marker.exists()


def test_forged_tensor_references_in_skeleton(tmp_path):
    # A skeleton that points at tensors the index does not hold, or at a non-integer index.
    for ref in (TensorRef(10**9), TensorRef("0"), TensorRef(-1)):
        path = tmp_path / "ref.nvc"
        nc.save({"w": torch.ones(3), "x": ref}, path)
        with pytest.raises(FormatError, match="refers to tensor"):
            nc.load(path)


def test_concurrent_weights_only_loads(tmp_path):
    # Regression: a per-call safe_globals context in one thread removed the allowance that
    # another thread's load relied on, failing it with a spurious UnsafeCheckpointError.
    path = tmp_path / "shared.nvc"
    tree = {"a": torch.ones(10), "b": [torch.zeros(3)] * 3, "n": 5}
    nc.save(tree, path)
    errors: list[BaseException] = []

    def work() -> None:
        for _ in range(60):
            try:
                assert_tree_equal(tree, nc.load(path))
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
