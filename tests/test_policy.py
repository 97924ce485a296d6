"""Classification of the trees real training code saves, and the policy applied per tensor.

Optimizer states come from real ``torch.optim`` steps; the Lightning checkpoint from a real
``Trainer.fit`` of one batch.
"""

from __future__ import annotations

import json

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 32)).square().mean().backward()
        opt.step()


def _components(path) -> dict[str, str]:
    with nc.open(path) as reader:
        return {k: reader.entry(k).component for k in reader.keys()}


def test_bare_state_dict_is_all_weights(tmp_path):
    model = _model()
    state = model.state_dict()
    report = nc.save(state, tmp_path / "sd.nvc")
    comps = _components(tmp_path / "sd.nvc")
    assert comps.keys() == state.keys()  # keys of a bare state_dict are the tensor keys
    assert set(comps.values()) == {"weights"}
    assert list(report.components) == ["weights"]
    back = nc.load(tmp_path / "sd.nvc")
    assert_tree_equal(state, back)
    _model().load_state_dict(back)


# Per optimizer: (constructor, {buffer name: expected component}); built from real steps.
OPTIMIZERS = {
    "adam_amsgrad": (
        lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
        {"step": "other", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "max_exp_avg_sq": "exp_avg_sq"},
    ),
    "adamw": (
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        {"step": "other", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    ),
    "sgd_momentum": (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), {"momentum_buffer": "exp_avg"}),
    "adafactor": (
        lambda p: torch.optim.Adafactor(p, lr=1e-2),
        {"step": "other", "row_var": "exp_avg_sq", "col_var": "exp_avg_sq", "variance": "exp_avg_sq"},
    ),
    "rmsprop_centered": (
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
        {"step": "other", "square_avg": "exp_avg_sq", "momentum_buffer": "exp_avg", "grad_avg": "exp_avg"},
    ),
}


@pytest.mark.parametrize("layout", ["model_optimizer", "bare_optimizer"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_classification(tmp_path, name, layout):
    make, expected = OPTIMIZERS[name]
    model = _model()
    opt = make(model.parameters())
    _train(model, opt)
    tree = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}
    if layout == "bare_optimizer":
        tree = opt.state_dict()
    path = tmp_path / f"{name}.nvc"
    nc.save(tree, path, nc.CodecPolicy(min_compress_bytes=0))
    comps = _components(path)

    prefix = "optimizer/" if layout == "model_optimizer" else ""
    seen = set()
    for pid, buffers in opt.state_dict()["state"].items():
        for buf, value in buffers.items():
            if isinstance(value, torch.Tensor):
                key = f"{prefix}state/{pid}/{buf}"
                assert comps[key] == expected[buf], (key, comps[key])
                seen.add(buf)
    assert seen == set(expected) - ({"step"} if name == "sgd_momentum" else set())
    if layout == "model_optimizer":
        assert {comps[f"model/{k}"] for k in model.state_dict()} == {"weights"}

    # The loaded state resumes training exactly like the original.
    back = nc.load(path)
    assert_tree_equal(tree, back)
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = make(model2.parameters())
    opt2.load_state_dict(back["optimizer"] if layout == "model_optimizer" else back)
    torch.manual_seed(1)
    _train(model, opt, 1)
    torch.manual_seed(1)
    _train(model2, opt2, 1)
    assert_tree_equal(model.state_dict(), model2.state_dict())


def test_gradients_and_other_subtrees(tmp_path):
    model = _model()
    model(torch.randn(8, 32)).sum().backward()
    tree = {
        "model": model.state_dict(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "rng_state": torch.get_rng_state(),
        "scaler": {"scale": torch.tensor(65536.0)},
        "lr_scheduler": {"base_lrs": [0.1], "last": torch.tensor([0.5])},
    }
    nc.save(tree, tmp_path / "g.nvc")
    comps = _components(tmp_path / "g.nvc")
    assert {v for k, v in comps.items() if k.startswith("grads/")} == {"gradients"}
    assert comps["rng_state"] == "other"
    assert comps["scaler/scale"] == "other"
    assert comps["lr_scheduler/last"] == "other"
    assert nc.classify(("model", "0.weight.grad")) == nc.Component.GRADIENTS


@pytest.fixture(scope="module")
def lightning_checkpoint(tmp_path_factory):
    """A checkpoint written by a real ``lightning.Trainer`` after one training batch."""
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    class EmaCallback(L.Callback):
        """Keeps a tensor in callback state, as EMA / SWA callbacks do."""

        def __init__(self) -> None:
            self.ema = torch.zeros(16, 8)

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            self.ema = 0.9 * self.ema + 0.1 * pl_module.net[0].weight.detach()

        def state_dict(self) -> dict:
            return {"ema": self.ema.clone()}

        def load_state_dict(self, state: dict) -> None:
            self.ema = state["ema"]

    class Tiny(L.LightningModule):
        def __init__(self, hidden: int = 16) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("lightning")
    data = DataLoader(TensorDataset(torch.randn(8, 8), torch.randn(8, 1)), batch_size=4)
    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=root,
        callbacks=[EmaCallback()],
    )
    trainer.fit(Tiny(), data)
    trainer.save_checkpoint(root / "last.ckpt")
    return torch.load(root / "last.ckpt", weights_only=False)


def test_lightning_checkpoint_classification(tmp_path, lightning_checkpoint):
    ckpt = lightning_checkpoint
    assert {"state_dict", "optimizer_states", "lr_schedulers", "callbacks", "loops"} <= ckpt.keys()
    report = nc.save(ckpt, tmp_path / "l.nvc", nc.CodecPolicy(min_compress_bytes=0))
    comps = _components(tmp_path / "l.nvc")
    by_component: dict[str, set[str]] = {}
    for key, comp in comps.items():
        by_component.setdefault(comp, set()).add(key)
    assert by_component["weights"] == {f"state_dict/{k}" for k in ckpt["state_dict"]}
    assert by_component["exp_avg"] == {f"optimizer_states/0/state/{i}/exp_avg" for i in range(4)}
    assert by_component["exp_avg_sq"] == {f"optimizer_states/0/state/{i}/exp_avg_sq" for i in range(4)}
    ema_key = next(k for k in comps if k.startswith("callbacks/") and k.endswith("/ema"))
    assert ema_key in by_component["other"]
    assert {f"optimizer_states/0/state/{i}/step" for i in range(4)} <= by_component["other"]
    assert list(report.components) == ["weights", "exp_avg", "exp_avg_sq", "other"]
    # Lightning's dict (loops, hyper_parameters, version string) loads weights-only.
    assert_tree_equal(ckpt, nc.load(tmp_path / "l.nvc"))


def test_user_patterns_and_overrides(tmp_path):
    torch.manual_seed(0)
    tree = {
        "model": {"ema.weight": torch.randn(64, 64), "body.weight": torch.randn(64, 64), "head.weight": torch.randn(64, 8)},
        "custom_opt": {"m1": torch.randn(64, 64), "m2": torch.rand(64, 64)},
    }
    policy = nc.CodecPolicy(
        exp_avg=nc.CodecSpec(codec="zstd", level=5, filter="none"),
        exp_avg_sq={"codec": "zstd", "level": 2},
        other="none",
        patterns={"model/ema.*": "other", "custom_opt/m1": "exp_avg", "custom_opt/*": nc.Component.EXP_AVG_SQ},
        overrides={"model/head.*": {"codec": "none", "filter": "none"}, "*/body.weight": nc.CodecSpec(level=9)},
    )
    nc.save(tree, tmp_path / "p.nvc", policy)
    with nc.open(tmp_path / "p.nvc") as reader:
        e = {k: reader.entry(k) for k in reader.keys()}
    assert (e["model/ema.weight"].component, e["model/ema.weight"].codec.id) == ("other", "none")
    # First matching pattern wins.
    assert e["custom_opt/m1"].component == "exp_avg"
    assert (e["custom_opt/m1"].codec.level, e["custom_opt/m1"].filter) == (5, "none")
    assert e["custom_opt/m2"].component == "exp_avg_sq" and e["custom_opt/m2"].codec.level == 2
    # Overrides pick the spec, the component still comes from classification.
    assert (e["model/head.weight"].codec.id, e["model/head.weight"].filter) == ("none", "none")
    assert e["model/head.weight"].component == "weights"
    assert (e["model/body.weight"].codec.id, e["model/body.weight"].codec.level) == ("zstd", 9)
    assert_tree_equal(tree, nc.load(tmp_path / "p.nvc"))


def test_tiny_tensors_are_stored_raw(tmp_path):
    tree = {
        "below": torch.ones(511),  # 2044 bytes
        "at": torch.ones(512),  # 2048 bytes
        "tiny_override": torch.ones(4),
    }
    policy = nc.CodecPolicy(overrides={"tiny_override": nc.CodecSpec(level=3)})
    nc.save(tree, tmp_path / "t.nvc", policy)
    with nc.open(tmp_path / "t.nvc") as reader:
        below, at, forced = (reader.entry(k) for k in ("below", "at", "tiny_override"))
    assert (below.codec.id, below.filter) == ("none", "none")
    assert all(f.is_raw for f in below.frames)
    assert (at.codec.id, at.filter) == ("zstd", "rotplane")  # weights: rotated byte planes
    assert at.stored_bytes < at.nbytes
    # An explicit override wins over the size threshold.
    assert (forced.codec.id, forced.codec.level) == ("zstd", 3)
    assert_tree_equal(tree, nc.load(tmp_path / "t.nvc"))


def test_per_component_stats(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt)
    tree = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    policy = nc.CodecPolicy(exp_avg_sq="none")
    report = nc.save(tree, tmp_path / "s.nvc", policy)
    size = (tmp_path / "s.nvc").stat().st_size
    assert report.stored_bytes == size
    with nc.open(tmp_path / "s.nvc") as reader:
        summary = reader.summary()
        entries = [reader.entry(k) for k in reader.keys()]
        assert reader.raw_bytes == report.raw_bytes and reader.file_bytes == size
    assert dict(report.components) == {k: summary[k] for k in report.components}
    for comp, stats in report.components.items():
        mine = [e for e in entries if e.component == comp]
        assert stats.tensors == len(mine)
        assert stats.raw_bytes == sum(e.nbytes for e in mine)
        assert stats.stored_bytes == sum(e.stored_bytes for e in mine)
    assert report.raw_bytes == sum(e.nbytes for e in entries)
    # File = tensor frames + magic, skeleton, index and footer.
    assert size > sum(s.stored_bytes for s in report.components.values())
    assert report.components["exp_avg_sq"].codecs == ("none",)
    assert report.components["exp_avg"].codecs == ("none", "zstd:1")  # the small bias moments are raw
    assert report.components["exp_avg"].ratio > 1.0
    table = report.table()
    for comp in ("weights", "exp_avg", "exp_avg_sq", "other", "total (file)"):
        assert comp in table
    as_dict = json.loads(json.dumps(report.to_dict()))
    assert as_dict["components"]["exp_avg_sq"]["stored_bytes"] == report.components["exp_avg_sq"].stored_bytes


def test_policy_dict_round_trip_and_validation():
    policy = nc.CodecPolicy(
        weights={"codec": "zstd", "level": 3},
        gradients="none",
        patterns={"ema/*": "other"},
        overrides={"head.*": {"codec": "zstd", "filter": "none", "chunk_bytes": 1 << 20}},
        min_compress_bytes=0,
        device="cpu",
    )
    data = json.loads(json.dumps(policy.to_dict()))
    assert nc.CodecPolicy.from_dict(data) == policy
    assert nc.CodecPolicy.uniform("none").exp_avg == nc.CodecSpec.from_dict("none")
    with pytest.raises(ValueError, match="unknown codec"):
        nc.CodecSpec(codec="lz77")
    with pytest.raises(ValueError, match="chunk_bytes"):
        nc.CodecSpec(chunk_bytes=100)
    with pytest.raises(ValueError):
        nc.CodecPolicy(patterns={"x": "not-a-component"})
    with pytest.raises(ValueError, match="device"):
        nc.CodecPolicy(device="tpu")
