"""The core's DeepSpeed backend (``entrypoint.deepspeed_engine``) without ranks: DeepSpeed's checkpoint-engine
interface without DeepSpeed's class, the engine test without importing DeepSpeed, attach's deprecated ``on_commit``."""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

import pytest

from nvcomp_checkpoint.entrypoint.deepspeed_engine import CommitInfo, NvcompCheckpointEngine, attach, is_deepspeed_engine


class Engine:
    """The attributes attach() touches on a DeepSpeed engine: its checkpoint engine and save_checkpoint."""

    checkpoint_engine = None

    def save_checkpoint(self, *args: object, **kwargs: object) -> bool:
        return True


def test_the_engine_has_every_method_of_deepspeeds_checkpoint_engine_without_deriving_from_it() -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

    assert CheckpointEngine not in NvcompCheckpointEngine.__mro__
    methods = [name for name, _ in inspect.getmembers(CheckpointEngine, inspect.isfunction) if not name.startswith("_")]
    assert {"create", "save", "load", "commit", "get_commit_info", "is_decoupled", "cleanup"} <= set(methods)
    for name in methods:
        theirs = list(inspect.signature(getattr(CheckpointEngine, name)).parameters)
        ours = list(inspect.signature(getattr(NvcompCheckpointEngine, name)).parameters)
        assert ours[: len(theirs)] == theirs, (name, ours, theirs)  # DeepSpeed passes some by keyword
    # What DeepSpeed's decoupled commit reads of get_commit_info(): CheckpointCommitInfo's fields.
    assert [f for f in CommitInfo.__dataclass_fields__] == list(CheckpointCommitInfo.__dataclass_fields__)


def test_a_deepspeed_engine_is_recognized_without_importing_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not is_deepspeed_engine(object())
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine: Any = DeepSpeedEngine.__new__(DeepSpeedEngine)  # its type is what counts, not its state
    assert is_deepspeed_engine(engine)
    monkeypatch.delitem(sys.modules, "deepspeed.runtime.engine")
    assert not is_deepspeed_engine(object())
    assert "deepspeed.runtime.engine" not in sys.modules  # asked, not imported


def test_on_commit_is_deprecated_for_on_saved_and_still_called_as_before() -> None:
    with pytest.warns(DeprecationWarning, match=r"attach\(on_commit=\.\.\.\) is deprecated: pass on_saved=") as caught:
        ours = attach(Engine(), on_commit=lambda save_dir, tag, reports: None)
    assert caught[0].filename == __file__  # the warning points at the caller's attach()
    assert ours.on_commit is not None and ours.on_saved is None and ours.last_report is None


def test_on_saved_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"attach\(on_saved=\.\.\.\) must be callable, got str"):
        attach(Engine(), on_saved="print")  # type: ignore[arg-type]
