"""``map_location`` of a load behaves as in ``torch.load``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc


def test_callable_map_location_is_used_as_torch_load_uses_it(tmp_path: Path) -> None:
    path = tmp_path / "m.nvc"
    x = torch.randn(1000)
    nc.save({"a": x}, path)
    shared = nc.load(path, map_location=lambda s, loc: s.clone().share_memory_())["a"]
    assert shared.is_shared() and torch.equal(shared, x)
    seen = []
    default = nc.load(path, map_location=lambda s, loc: seen.append(loc))["a"]
    assert seen == ["cpu"] and default.device.type == "cpu" and torch.equal(default, x)
    with pytest.raises(nc.CheckpointError, match="map_location returned int"):
        nc.load(path, map_location=lambda s, loc: 5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_map_location_without_cuda_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "g.nvc"
    nc.save({"x": torch.randn(100)}, path)
    for ml in ("cuda", torch.device("cuda:0"), {"cpu": "cuda:0"}):
        with pytest.raises(nc.CheckpointError, match=r"g\.nvc.*map_location='cpu'"):
            nc.load(path, map_location=ml)
