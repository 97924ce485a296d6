"""What stock loaders say about our files: ``torch.load`` (both ``weights_only`` modes) names our loader.

Every file ``nc.save`` writes starts with the guard (docs/format.md "The guard"): a fixed pickle
whose one global a weights-only ``torch.load`` refuses by a name that is the hint, and that a full
unpickler resolves to our refusal, which raises and runs nothing else. Lightning's stock loaders
(``load_from_checkpoint``, ``pl_load``) are covered in ``test_lightning.py`` on a Trainer's file.
"""

from __future__ import annotations

import pickle
import pickletools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import FormatError

#: The guard, byte for byte, as docs/format.md states it: part of the format, never changed.
GUARD = (
    b"\x80\x02cnvcomp_checkpoint.format.guard\n"
    b"compressed_by_nvcomp-checkpoint:load_it_with_nvcomp_checkpoint.load(path)"
    b"_or_Lightning_Trainer(plugins=[NvcompCheckpointIO()])\n."
)
HINTS = ("nvcomp_checkpoint.load(path)", "Trainer(plugins=[NvcompCheckpointIO()])")

#: ``pickle.find_class`` audit events while a test listens (an audit hook cannot be removed).
_FIND_CLASS: list[tuple[str, str]] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "pickle.find_class" and _FIND_CLASS is not None:
        _FIND_CLASS.append((str(args[0]), str(args[1])))


sys.addaudithook(_audit)


def _tree() -> dict[str, Any]:
    torch.manual_seed(0)
    w = torch.randn(64, 32)
    return {"model": {"w": w, "b": torch.zeros(32)}, "optimizer": {"state": {0: {"exp_avg": w * 0.1}}}, "step": 7}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A full file and a delta of it, as ``nc.save`` writes them."""
    root = tmp_path_factory.mktemp("stock")
    tree = _tree()
    nc.save(tree, root / "full.nvc")
    tree["model"]["w"] = tree["model"]["w"] + 1e-3
    nc.save(tree, root / "delta.nvc", base=root / "full.nvc")
    return {"full": root / "full.nvc", "delta": root / "delta.nvc"}


def test_every_file_starts_with_the_guard_then_the_magic(files):
    for kind, path in files.items():
        data = path.read_bytes()
        assert data.startswith(GUARD + b"NVCKPT"), kind
    # One complete pickle: PROTO 2, one GLOBAL, STOP; fixed ASCII bytes on every Python.
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(GUARD)]
    assert [name for name, _ in ops] == ["PROTO", "GLOBAL", "STOP"] and ops[0][1] == 2
    assert GUARD[2:].isascii()  # after PROTO 2
    from nvcomp_checkpoint.format.layout import GUARD as written

    assert written == GUARD


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_weights_only_torch_load_names_our_loader(files, kind):
    for call in (lambda p: torch.load(p), lambda p: torch.load(p, weights_only=True, map_location="cpu")):
        with pytest.raises(pickle.UnpicklingError) as caught:
            call(files[kind])
        assert all(hint in str(caught.value) for hint in HINTS), str(caught.value)
    with open(files[kind], "rb") as f:  # a stream, as Lightning's fsspec loader passes it
        with pytest.raises(pickle.UnpicklingError, match=r"nvcomp_checkpoint\.load\(path\)"):
            torch.load(f)


def test_full_torch_load_runs_only_our_refusal(files, monkeypatch):
    """``weights_only=False``: the one global resolved is the guard's, our refusal runs once and
    raises; no other global is looked up, so nothing of the file runs."""
    global _FIND_CLASS
    from nvcomp_checkpoint.format import guard

    calls: list[int] = []
    refuse = guard.refuse_stock_loader

    def sentinel() -> Any:
        calls.append(1)
        return refuse()

    monkeypatch.setattr(guard, "refuse_stock_loader", sentinel)
    for path in files.values():
        _FIND_CLASS = []
        try:
            with pytest.raises(FormatError) as caught:
                torch.load(path, weights_only=False)
            found = _FIND_CLASS
        finally:
            _FIND_CLASS = None
        assert found == [(guard.MODULE, guard.NAME)]
        message = str(caught.value)
        assert all(hint in message for hint in HINTS) and "NvcompCheckpointIO().load_checkpoint" in message, message
    assert len(calls) == len(files)
    # Our own readers find the magic without unpickling the guard.
    _FIND_CLASS = []
    try:
        back = nc.load(files["delta"])
        with nc.open(files["full"]) as reader:
            assert all(err is None for _, err in reader.verify())
        found = _FIND_CLASS
    finally:
        _FIND_CLASS = None
    assert len(calls) == len(files) and (guard.MODULE, guard.NAME) not in found
    assert set(back) == {"model", "optimizer", "step"}


def test_the_refusal_answers_only_its_own_name():
    from nvcomp_checkpoint.format import guard

    with pytest.raises(AttributeError):
        guard.something_else  # noqa: B018
    with pytest.raises(FormatError):
        getattr(guard, guard.NAME)
    # A full unpickler that splits dotted names (Python 3.14 does, for every protocol) asks for
    # the first part only.
    with pytest.raises(FormatError):
        getattr(guard, guard.NAME.split(".")[0])


@pytest.mark.parametrize(
    "forged",
    [
        pytest.param(b"\x80\x02cnvcomp_checkpoint.format.guard\nsomething_else\n.", id="another-name"),
        pytest.param(b"\x80\x02cbuiltins\nprint\n)R.", id="another-pickle"),
        pytest.param(GUARD[:-1] + b"N", id="no-stop"),
    ],
)
def test_only_the_exact_guard_is_read_past(files, tmp_path, forged):
    """A file whose first pickle is not exactly the guard is not ours, however its tail looks:
    refused before anything is unpickled."""
    global _FIND_CLASS
    data = files["full"].read_bytes()
    path = tmp_path / "forged.nvc"
    path.write_bytes(forged + data[len(GUARD) :])
    _FIND_CLASS = []
    try:
        with pytest.raises(FormatError, match="header is damaged"):
            nc.load(path)
        with pytest.raises(FormatError):
            nc.open(path)
        assert not nc.is_nvcomp_checkpoint(path)
        found = _FIND_CLASS
    finally:
        _FIND_CLASS = None
    assert found == []


def test_files_without_the_guard_still_load(tmp_path):
    """Files written before the guard (the golden files of every version) start with the magic."""
    data_dir = Path(__file__).resolve().parent / "data"
    for name in ("golden_v1.nvc", "golden_v2_delta.nvc", "golden_v3_sub.nvc"):
        assert (data_dir / name).read_bytes()[:6] == b"NVCKPT", name
        assert nc.is_nvcomp_checkpoint(data_dir / name)
        with nc.open(data_dir / name) as reader:
            assert all(err is None for _, err in reader.verify()), name
    # And a file with the guard holds the same tree as one without.
    tree = nc.load(data_dir / "golden_v1.nvc")
    nc.save(tree, tmp_path / "again.nvc")
    assert (tmp_path / "again.nvc").read_bytes().startswith(GUARD)
    assert_tree_equal(tree, nc.load(tmp_path / "again.nvc"))
