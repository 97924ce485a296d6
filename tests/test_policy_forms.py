"""Every ``policy=`` takes the same forms: a CodecPolicy, a dict of its fields, or a codec shorthand."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"layer.weight": torch.randn(64, 64, generator=g), "layer.bias": torch.randn(64, generator=g)}


def _levels(path: Path) -> set[tuple[str, int | None]]:
    with nc.open(path) as r:
        return {(r.entry(k).codec.id, r.entry(k).codec.level) for k in r.keys() if r.entry(k).codec.id != "none"}


def test_spec_shorthand_is_the_clis() -> None:
    assert nc.CodecSpec.parse("zstd:3") == nc.CodecSpec(codec="zstd", level=3)
    assert nc.CodecSpec.parse("zstd:3:none") == nc.CodecSpec(codec="zstd", level=3, filter="none")
    assert nc.CodecSpec.parse("none") == nc.CodecSpec(codec="none", level=None, filter="none")
    assert nc.CodecSpec.parse("zstd") == nc.CodecSpec()
    assert nc.CodecPolicy(weights="zstd:3").weights.level == 3


@pytest.mark.parametrize("form", ["zstd:3", {"weights": "zstd:3"}, {"weights": {"codec": "zstd", "level": 3}}])
def test_save_and_save_async_take_every_form(tmp_path: Path, form: object) -> None:
    nc.save(_state(), tmp_path / "a.nvc", policy=form)  # type: ignore[arg-type]
    nc.save_async(_state(), tmp_path / "b.nvc", policy=form).result()  # type: ignore[arg-type]
    for name in ("a.nvc", "b.nvc"):
        assert ("zstd", 3) in _levels(tmp_path / name)
        assert torch.equal(nc.load(tmp_path / name)["layer.weight"], _state()["layer.weight"])


def test_manager_takes_a_shorthand(tmp_path: Path) -> None:
    with nc.CheckpointManager([nc.Tier(str(tmp_path / "t0"))], policy="zstd:3", async_save=False) as m:
        m.save(1, _state())
    (unit,) = [p for p in (tmp_path / "t0").rglob("*.nvc")]
    assert _levels(unit) == {("zstd", 3)}


@pytest.mark.parametrize(
    ("form", "error", "names"),
    [
        ("zstd:fast", ValueError, "'fast' is neither a level nor a filter"),
        ("zsdt", ValueError, "unknown codec 'zsdt'"),
        ({"wieghts": "zstd"}, ValueError, "unknown policy key(s) ['wieghts']"),
        ({"weights": "zstd:99"}, ValueError, "weights: codec spec 'zstd:99'"),
        (3, TypeError, "expected a CodecPolicy, a dict of its fields"),
    ],
)
def test_bad_forms_are_refused_at_construction_naming_the_entry_point(
    tmp_path: Path, form: object, error: type, names: str
) -> None:
    from nvcomp_checkpoint.dcp import NvcompWriter
    from nvcomp_checkpoint.integrations.accelerate import register_nvcomp_hooks  # noqa: F401 - importable
    from nvcomp_checkpoint.integrations.lightning import NvcompCheckpointIO
    from nvcomp_checkpoint.integrations.transformers import NvcompTrainerCallback

    attempts = {
        "save(policy=...)": lambda: nc.save(_state(), tmp_path / "x.nvc", policy=form),
        "save_async(policy=...)": lambda: nc.save_async(_state(), tmp_path / "y.nvc", policy=form),
        "CheckpointManager(policy=...)": lambda: nc.CheckpointManager([nc.Tier(str(tmp_path / "t"))], policy=form),
        "NvcompWriter(policy=...)": lambda: NvcompWriter(tmp_path / "d", policy=form),
        "NvcompCheckpointIO(policy=...)": lambda: NvcompCheckpointIO(policy=form),
        "NvcompTrainerCallback(policy=...)": lambda: NvcompTrainerCallback(policy=form),
    }
    for where, attempt in attempts.items():
        with pytest.raises(error) as info:
            attempt()
        assert names in str(info.value), (where, str(info.value))
        assert where.split("(")[0] + "(policy=...)" in str(info.value), (where, str(info.value))
    assert not list(tmp_path.rglob("*.nvc"))


def test_an_override_that_matches_nothing_warns_once(tmp_path: Path) -> None:
    policy = nc.CodecPolicy(overrides={"layr.*": "none", "layer.bias": "none"})
    with pytest.warns(UserWarning, match=r"override 'layr\.\*' matches no tensor key"):
        nc.save(_state(), tmp_path / "a.nvc", policy=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nc.save(_state(), tmp_path / "b.nvc", policy=policy)


def test_an_unmatched_override_warning_shows_real_keys_and_points_at_the_caller(tmp_path: Path) -> None:
    policy = nc.CodecPolicy(overrides={"modle.*": "none"})
    with pytest.warns(UserWarning, match=r"override 'modle\.\*' matches no tensor key") as record:
        nc.save({"model": _state()}, tmp_path / "c.nvc", policy=policy)
    (warning,) = [w for w in record if "modle" in str(w.message)]
    assert "keys of this save look like 'model/layer.weight'" in str(warning.message), warning.message
    assert warning.filename == __file__, warning.filename  # the line that saved, not writer.py
