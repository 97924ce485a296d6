"""The scale benchmark's state: a real checkpoint's values tiled in order into a memory-mapped training state."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

import nvcomp_checkpoint as nc

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(name: str) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # bench_scale imports checkpoints, methods, results_store by name
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


scale = _module("bench_scale")


def _trained_like() -> dict:
    """A checkpoint shaped as checkpoints.py's: two parameters, AdamW state, bf16 gradients."""
    g = torch.Generator().manual_seed(0)
    params = {"a.weight": torch.randn(3, 5, generator=g), "b.weight": torch.randn(7, generator=g)}
    state = {
        i: {
            "step": torch.tensor(2.0),
            "exp_avg": torch.randn(p.shape, generator=g),
            "exp_avg_sq": torch.rand(p.shape, generator=g),
        }
        for i, p in enumerate(params.values())
    }
    return {
        "model": params,
        "optimizer": {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "gradients": {n: torch.randn(p.shape, generator=g).to(torch.bfloat16) for n, p in params.items()},
    }


def test_the_state_repeats_the_real_streams_in_order_and_lives_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scale, "HIDDEN", 4)
    monkeypatch.setattr(scale, "FFN", 6)
    monkeypatch.setattr(scale, "VOCAB", 8)
    source = _trained_like()
    streams = scale.source_streams(source)
    assert streams.weight.size == 22 and streams.group == {"lr": 1e-3, "betas": (0.9, 0.999)}
    path = tmp_path / "state.bin"
    scale.write_state(path, 2, streams)
    state, mm = scale.map_state(path)

    total = scale.numel(2)
    assert total > 2 * streams.weight.size  # the streams wrap around
    names = [n for n, _ in scale.layout(2)]
    assert list(state["model"]) == names and list(state["gradients"]) == names
    assert [state["model"][n].shape for n in names] == [torch.Size(s) for _, s in scale.layout(2)]
    opt = state["optimizer"]
    assert opt["param_groups"] == [{"lr": 1e-3, "betas": [0.9, 0.999], "params": list(range(len(names)))}]
    per_component = {
        "weight": [state["model"][n] for n in names],
        "exp_avg": [opt["state"][i]["exp_avg"] for i in range(len(names))],
        "exp_avg_sq": [opt["state"][i]["exp_avg_sq"] for i in range(len(names))],
        "grad": [state["gradients"][n] for n in names],
    }
    base = mm.ctypes.data
    for comp, tensors in per_component.items():
        assert {t.dtype for t in tensors} == {torch.float32 if comp.startswith("exp_avg") else torch.bfloat16}
        flat = torch.cat([t.reshape(-1) for t in tensors])
        stream = getattr(streams, comp)
        want = torch.from_numpy(np.resize(stream, total))
        assert torch.equal(flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat, want), comp
        # Every tensor is a view of the file mapping: the state takes no anonymous memory.
        assert all(base <= t.data_ptr() < base + mm.size for t in tensors)
    # Each parameter's four components come from the same place of the real state, so the first
    # parameter's weight, moments and gradient are the real first parameter's, element for element.
    first = names[0]
    real = source["model"]["a.weight"].reshape(-1)
    assert torch.equal(state["model"][first].reshape(-1)[:15], real.to(torch.bfloat16))
    assert torch.equal(opt["state"][0]["exp_avg"].reshape(-1)[:15], source["optimizer"]["state"][0]["exp_avg"].reshape(-1))
    assert torch.equal(state["gradients"][first].reshape(-1)[:15], source["gradients"]["a.weight"].reshape(-1))
    # Our policy sees the components a training state has.
    flat_paths = scale.flat_tensors(state)
    kinds = {nc.classify(tuple(k.split("/"))).value for k in flat_paths}
    assert kinds == {"weights", "exp_avg", "exp_avg_sq", "gradients", "other"}


def test_a_fit_is_intercept_and_slope() -> None:
    assert scale.fit([1.0], [2.0]) is None
    a, b = scale.fit([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
