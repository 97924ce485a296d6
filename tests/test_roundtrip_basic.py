"""Save/load round trips of a real (tiny) training state."""

from __future__ import annotations

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal


def _trained_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "name": "run-1"}


def test_save_load_bit_identical(tmp_path):
    state = _trained_state()
    report = nc.save(state, tmp_path / "ckpt.nvc")
    assert report.stored_bytes == (tmp_path / "ckpt.nvc").stat().st_size
    assert report.raw_bytes > report.stored_bytes
    assert set(report.components) >= {"weights", "exp_avg", "exp_avg_sq"}
    assert_tree_equal(state, nc.load(tmp_path / "ckpt.nvc"))


def test_open_reads_one_tensor(tmp_path):
    state = _trained_state()
    nc.save(state, tmp_path / "ckpt.nvc")
    with nc.open(tmp_path / "ckpt.nvc") as reader:
        assert "optimizer/state/0/exp_avg" in reader.keys()
        assert reader.entry("optimizer/state/0/exp_avg").component == "exp_avg"
        assert torch.equal(reader.read("model/0.weight"), state["model"]["0.weight"])
        assert reader.summary()["exp_avg_sq"].tensors == 4


def test_load_plain_torch_save(tmp_path):
    state = _trained_state()
    torch.save(state, tmp_path / "plain.pt")
    assert not nc.is_nvcomp_checkpoint(tmp_path / "plain.pt")
    assert_tree_equal(state, nc.load(tmp_path / "plain.pt"))


def test_sparse_tensor_is_refused_with_the_fix(tmp_path):
    import pytest

    from nvcomp_checkpoint.errors import UnsupportedObjectError

    with pytest.raises(UnsupportedObjectError, match=r"'s'.*to_dense"):
        nc.save({"s": torch.eye(3).to_sparse()}, tmp_path / "sparse.nvc")
    assert not (tmp_path / "sparse.nvc").exists()


@pytest.mark.parametrize("what", ["model", "optimizer"])
def test_a_model_or_optimizer_object_is_refused_with_its_state_dict_named(tmp_path, what):
    model = torch.nn.Linear(4, 4)
    obj = model if what == "model" else torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nc.errors.UnsupportedObjectError) as info:
        nc.save({"run": {what: obj}}, tmp_path / "m.nvc")
    text = str(info.value)
    assert f"'run/{what}' is a {type(obj).__name__} object, not its state" in text, text
    assert f"save {what}.state_dict() instead" in text, text
    assert not (tmp_path / "m.nvc").exists()


def test_a_module_without_tensors_is_still_pickled_as_before(tmp_path):
    # A loss module in Lightning's hyper_parameters holds no tensor: it was saved before, and still is.
    nc.save({"loss": torch.nn.CrossEntropyLoss(), "w": torch.ones(3)}, tmp_path / "loss.nvc")
    assert isinstance(nc.load(tmp_path / "loss.nvc", weights_only=False)["loss"], torch.nn.CrossEntropyLoss)
