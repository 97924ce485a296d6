"""Every ``incremental=`` takes the same forms (``False``, ``True`` with ``full_every``/``delta_base``, a
``ChainPolicy``), converted by one function; a ChainPolicy with ``full_every`` or ``delta_base`` is refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.delta import chain_policy_of


def _lightning(**keywords: Any) -> nc.ChainPolicy | None:
    from nvcomp_checkpoint.lightning import NvcompCheckpointIO

    plugin = NvcompCheckpointIO(**keywords)
    try:
        return None if plugin.incremental is None else plugin.incremental.policy
    finally:
        plugin.close("the test")


def _accelerate(**keywords: Any) -> nc.ChainPolicy | None:
    from accelerate import Accelerator

    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks

    acc = Accelerator(cpu=True)
    try:
        hooks = register_nvcomp_hooks(acc, **keywords)
    except (TypeError, ValueError):
        # Refused before the accelerator was touched: hooks can still be registered.
        register_nvcomp_hooks(acc).remove()
        raise
    try:
        return None if hooks.incremental is None else hooks.incremental.policy
    finally:
        hooks.remove()


def _manager(tmp: Path) -> Callable[..., nc.ChainPolicy | None]:
    def build(**keywords: Any) -> nc.ChainPolicy | None:
        with nc.CheckpointManager([nc.Tier(tmp / "t0")], async_save=False, **keywords) as mgr:
            return mgr.chain_policy

    return build


def _deepspeed(**keywords: Any) -> nc.ChainPolicy | None:
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from nvcomp_checkpoint.deepspeed import attach

    class Engine:  # what attach() touches of a DeepSpeedEngine before any save
        checkpoint_engine = None

        def save_checkpoint(self, *args: object, **kwargs: object) -> bool:
            return True

    engine = Engine()
    try:
        ours = attach(engine, **keywords)
    except (TypeError, ValueError):
        assert engine.checkpoint_engine is None  # refused before the engine was touched
        raise
    return None if ours.incremental is None else ours.incremental.policy


ENTRY_POINTS = ["NvcompCheckpointIO", "register_nvcomp_hooks", "CheckpointManager", "attach"]


def _entry(name: str, tmp: Path) -> Callable[..., nc.ChainPolicy | None]:
    return {
        "NvcompCheckpointIO": _lightning,
        "register_nvcomp_hooks": _accelerate,
        "CheckpointManager": _manager(tmp),
        "attach": _deepspeed,
    }[name]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_takes_every_form(tmp_path: Path, name: str) -> None:
    build = _entry(name, tmp_path)
    policy = nc.ChainPolicy(full_every=3, base="full")
    assert build(incremental=policy) == policy
    assert build(incremental=True, full_every=4, delta_base="full") == nc.ChainPolicy(4, "full")
    assert build(incremental=True) == nc.ChainPolicy(10, "previous")
    assert build(incremental=False) is None


@pytest.mark.parametrize("name", ENTRY_POINTS)
@pytest.mark.parametrize(
    ("extra", "named"), [({"full_every": 5}, "full_every=..."), ({"delta_base": "previous"}, "delta_base=...")]
)
def test_a_chain_policy_with_its_own_keywords_is_refused_naming_both(
    tmp_path: Path, name: str, extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError) as info:
        _entry(name, tmp_path)(incremental=nc.ChainPolicy(3), **extra)
    message = str(info.value)
    assert f"{name}(incremental=ChainPolicy(...), {named})" in message
    assert "incremental=ChainPolicy(full_every=3, base='previous')" in message  # the fix, spelled out


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_wrong_forms_are_refused_at_construction(tmp_path: Path, name: str) -> None:
    build = _entry(name, tmp_path)
    with pytest.raises(TypeError, match=r"incremental=\.\.\.\) takes True, False or a ChainPolicy"):
        build(incremental="previous")
    with pytest.raises(ValueError, match=r"incremental=True, delta_base=\.\.\.\): base must be 'previous' or 'full'"):
        build(incremental=True, delta_base="last")


def test_the_trainer_callback_refuses_every_incremental_form_without_deepspeed(tmp_path: Path) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from nvcomp_checkpoint.transformers import NvcompTrainerCallback

    # Converted when made; refused when the Trainer is built (on_init_end), which tells DeepSpeed apart.
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    NvcompTrainerCallback(incremental=False).on_init_end(args, TrainerState(), TrainerControl())
    for form in (True, nc.ChainPolicy(3)):
        callback = NvcompTrainerCallback(incremental=form)
        with pytest.raises(ValueError, match="is not supported: the Trainer deletes old checkpoint-N"):
            callback.on_init_end(args, TrainerState(), TrainerControl())
    with pytest.raises(TypeError, match="takes True, False or a ChainPolicy"):
        NvcompTrainerCallback(incremental="yes")  # type: ignore[arg-type]


def test_one_conversion() -> None:
    policy = nc.ChainPolicy(2)
    assert chain_policy_of(policy, None, None, "X") is policy
    assert chain_policy_of(True, None, None, "X") == nc.ChainPolicy()
    assert chain_policy_of(False, 3, "full", "X") is None
    with pytest.raises(ValueError, match=r"X\(incremental=True, full_every=\.\.\.\): full_every must be an int >= 1"):
        chain_policy_of(True, 0, None, "X")
