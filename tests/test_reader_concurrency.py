"""One open reader: many threads at once, and a path replaced under it."""

from __future__ import annotations

from pathlib import Path

import torch

import nvcomp_checkpoint as nc


def test_one_reader_serves_many_threads(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    obj = {f"t{i}": torch.randn(20000 + i) for i in range(16)}
    path = tmp_path / "r.nvc"
    nc.save(obj, path)
    with nc.open(path) as reader:
        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(lambda k: all(torch.equal(reader.read(k), obj[k]) for _ in range(10)), obj))
    assert all(results)


def test_an_open_reader_keeps_reading_its_file_when_a_save_replaces_the_path(tmp_path: Path) -> None:
    path = tmp_path / "last.nvc"
    old = {"w": torch.randn(5000)}
    nc.save(old, path)
    with nc.open(path) as reader:
        nc.save({"w": torch.randn(90000), "more": torch.randn(100)}, path)  # atomic replace
        assert torch.equal(reader.read("w"), old["w"])
        assert reader.file_bytes < path.stat().st_size
