"""Plain ``torch.save`` files: what a load builds is counted from the pickle before anything is built.

A few hundred bytes of pickle can declare a view of 2**40 elements over a 4-byte storage, a
device copy that materializes such a view, or a tensor constructor called with a size. The reader
counts the storages and views the pickle builds (each view must fit its storage; each storage must
be the size of its record) against ``max_bytes`` first; ``nvckpt compress`` refuses with its own error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from forged_files import REDUCE, TUPLE1, archive, global_op, pickle2, plain_view, str_op
from nvcomp_checkpoint.errors import FormatError, SizeLimitError
from nvcomp_checkpoint.format.torchsave import check_torch_archive

MiB = 1 << 20


def _write(tmp_path: Path, data: bytes, name: str = "plain.pt") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_stride0_view_counts_what_it_spans(tmp_path: Path) -> None:
    path = _write(tmp_path, plain_view((1 << 40,), (0,)))
    assert path.stat().st_size < 2000
    with pytest.raises(SizeLimitError, match=r"4398046511104 bytes.*over max_bytes=1048576") as info:
        nc.load(path, max_bytes=MiB)
    assert str(path) in str(info.value)


def test_a_device_copy_of_a_view_is_counted_before_it_is_made(tmp_path: Path) -> None:
    float64 = global_op("torch", "float64") + str_op("cpu") + b"\x89"
    data = plain_view((1 << 24,), (0,), wrap=("torch._utils", "_rebuild_device_tensor_from_cpu_tensor", float64))
    path = _write(tmp_path, data)
    with pytest.raises(SizeLimitError, match=r"copies: 134217732.*over max_bytes=1048576"):
        nc.load(path, max_bytes=MiB)


def test_a_view_past_the_end_of_its_storage_is_refused(tmp_path: Path) -> None:
    for size, stride, offset in (((10,), (1,), 0), ((2, 3), (3, 1), 0), ((1,), (1,), 5)):
        path = _write(tmp_path, plain_view(size, stride, offset=offset))
        with pytest.raises(FormatError, match="past the end of its storage") as info:
            nc.load(path)
        assert str(path) in str(info.value)


def test_a_storage_of_another_size_than_its_record_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, plain_view((1,), (1,), numel=1 << 31))
    with pytest.raises(FormatError, match="declares 8589934592 bytes.*record holds 4"):
        nc.load(path, max_bytes=MiB)


def test_a_tensor_constructor_called_with_a_size_is_refused(tmp_path: Path) -> None:
    data = archive(pickle2(global_op("torch", "FloatTensor") + b"J" + (1 << 24).to_bytes(4, "little") + TUPLE1 + REDUCE))
    path = _write(tmp_path, data)
    with pytest.raises(FormatError, match="calls torch.FloatTensor"):
        nc.load(path)


def test_views_of_one_storage_count_it_once(tmp_path: Path) -> None:
    x = torch.arange(1000.0)
    path = tmp_path / "views.pt"
    torch.save({"a": x[:10], "b": x[10:], "tied": x, "e": torch.zeros(1).expand(100)}, path)
    with path.open("rb") as f:
        counted = check_torch_archive(f, path.stat().st_size, str(path))
    # x's storage once, e's one element, and the 99 elements e shows beyond it.
    assert (counted.allocated, counted.expanded, counted.needed) == (4004, 396, 4400)
    loaded = nc.load(path, max_bytes=path.stat().st_size)
    assert torch.equal(loaded["b"], x[10:]) and loaded["e"].shape == (100,)


def test_compress_refuses_a_view_larger_than_memory_with_its_own_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nvcomp_checkpoint.cli._ui import EXIT_ERROR
    from nvcomp_checkpoint.cli.main import main

    path = _write(tmp_path, plain_view((1 << 40,), (0,)))
    code = main(["compress", str(path), str(tmp_path / "out.nvc")])
    err = capsys.readouterr().err
    assert code == EXIT_ERROR, err
    assert "this is a bug" not in err and str(path) in err and "4398046511104 bytes" in err, err
    assert not (tmp_path / "out.nvc").exists()
