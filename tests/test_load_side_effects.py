"""Loading a file changes nothing outside the objects it returns.

A pickle may name allow-listed classes and enum members; the weights-only rules let it ``BUILD``
state into what it names. An enum member (DeepSpeed's ``ZeroStageEnum.disabled``, DCP's
``_MEM_FORMAT_ENCODING``) and a class are module-level objects: a forged file that sets their state
would change them for the whole process (the run's next checkpoint pickles the wrong value). Each
forgery goes through every entry point that reads such a file; each must leave the objects as they
were, and either load the right member or be refused with our error.
"""

from __future__ import annotations

import pathlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import nvcomp_checkpoint as nc
from forged_files import (
    EMPTY_DICT,
    MARK,
    REDUCE,
    SETITEM,
    SETITEMS,
    TUPLE1,
    archive,
    global_op,
    int_op,
    pickle2,
    ref,
    str_op,
    with_object_tree,
)
from nvcomp_checkpoint.errors import FormatError

BUILD, NONE, TUPLE2 = b"b", b"N", b"\x86"


@pytest.fixture
def zero_stage() -> Iterator[Any]:
    """DeepSpeed's ``ZeroStageEnum``, its members' state restored after the test (a failing run mutates it)."""
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    enum = config.ZeroStageEnum
    saved = {member: dict(vars(member)) for member in enum}
    yield enum
    for member, state in saved.items():
        vars(member).clear()
        vars(member).update(state)


def _member_state(enum: Any) -> list[tuple[str, Any]]:
    return [(m._name_, m._value_) for m in enum]


def _forged_stage(slots: bool) -> bytes:
    """``ZeroStageEnum(0)`` (its member ``disabled``), then BUILD renaming it to ``optimizer_states`` = 1:
    as a ``__dict__`` state, or as a slot state (``setattr``)."""
    state = EMPTY_DICT + MARK + str_op("_name_") + str_op("optimizer_states") + str_op("_value_") + int_op(1) + SETITEMS
    return (
        global_op("deepspeed.runtime.zero.config", "ZeroStageEnum")
        + int_op(0)
        + TUPLE1
        + REDUCE
        + ((NONE + state + TUPLE2) if slots else state)
        + BUILD
    )


def _model_states(stage: bytes, with_tensor: bool) -> bytes:
    """A DeepSpeed model-states tree ``{"module": {"w": TensorRef(0)}?, "zero_stage": <stage>}``."""
    module = str_op("module") + EMPTY_DICT + str_op("w") + ref(0) + SETITEM if with_tensor else b""
    return pickle2(EMPTY_DICT + MARK + module + str_op("zero_stage") + stage + SETITEMS)


def _tag(root: Path, data: bytes) -> Path:
    """A DeepSpeed folder whose one tag holds ``data`` as its model states (a plain tag: no manifest)."""
    tag = root / "ckpt" / "t1"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(data)
    (root / "ckpt" / "latest").write_text("t1")
    return tag / "mp_rank_00_model_states.pt"


@pytest.mark.parametrize("slots", [False, True], ids=["dict-state", "slot-state"])
@pytest.mark.parametrize("fmt", ["plain", "ours"])
def test_a_forged_enum_member_state_changes_nothing(
    tmp_path: Path, zero_stage: Any, fmt: str, slots: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from nvcomp_checkpoint.cli._ui import EXIT_ERROR, EXIT_FAILED
    from nvcomp_checkpoint.cli.main import main
    from nvcomp_checkpoint.deepspeed_layout import deepspeed_safe_globals, load_deepspeed_file, write_manifest

    before = _member_state(zero_stage)
    if fmt == "plain":
        path = _tag(tmp_path, archive(_model_states(_forged_stage(slots), with_tensor=False)))
    else:
        valid = tmp_path / "valid.nvc"
        nc.save({"module": {"w": torch.ones(3)}}, valid)
        path = _tag(tmp_path, with_object_tree(valid.read_bytes(), archive(_model_states(_forged_stage(slots), True))))
        write_manifest(path.parent, "t1", 1, {path.name: path.stat().st_size})

    def with_allow_list() -> Any:
        with deepspeed_safe_globals():
            return nc.load(path, weights_only=True)

    for name, call in (("nc.load", with_allow_list), ("load_deepspeed_file", lambda: load_deepspeed_file(path))):
        with pytest.raises(FormatError, match="module-level object") as info:
            call()
        assert str(path) in str(info.value), f"{name}: {info.value}"
        assert _member_state(zero_stage) == before, f"{name} changed ZeroStageEnum"
    for command in ("verify", "compress"):
        code = main([command, str(tmp_path / "ckpt")])
        out = capsys.readouterr()
        assert "this is a bug" not in out.err, f"nvckpt {command}: {out.err}"
        if command == "verify" or fmt == "plain":  # compress leaves a tag that is ours already as it is
            assert code == (EXIT_FAILED if command == "verify" else EXIT_ERROR) and "module-level object" in out.out + out.err, (
                f"nvckpt {command}: {code}, {out.out}{out.err}"
            )
        assert _member_state(zero_stage) == before, f"nvckpt {command} changed ZeroStageEnum"


def test_an_enum_member_without_state_loads_as_the_member(tmp_path: Path, zero_stage: Any) -> None:
    from nvcomp_checkpoint.deepspeed_layout import load_deepspeed_file

    stage = global_op("deepspeed.runtime.zero.config", "ZeroStageEnum") + int_op(2) + TUPLE1 + REDUCE
    path = _tag(tmp_path, archive(_model_states(stage, with_tensor=False)))
    assert load_deepspeed_file(path)["zero_stage"] is zero_stage.gradients
    torch.save({"zero_stage": zero_stage.weights, "module": {"w": torch.ones(2)}}, path)
    assert load_deepspeed_file(path)["zero_stage"] is zero_stage.weights


# -- DCP metadata: the allow-list names classes and an enum -------------------------------------------
def _u(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _metadata_forgeries() -> dict[str, tuple[bytes, Any, str]]:
    """Plain ``.metadata`` pickles that set state on a module-level object: (pickle, object, attribute)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    dcp_md = "torch.distributed.checkpoint.metadata"
    forged_attr = b"}" + _u("forged") + b"K\x01s"
    return {
        # BUILD with a slot state on a class: setattr(PosixPath, "forged", 1).
        "class-slot-state": (
            b"\x80\x04" + _u("pathlib") + _u("PosixPath") + b"\x93N" + forged_attr + b"\x86b.",
            pathlib.PosixPath,
            "forged",
        ),
        # STACK_GLOBAL of the enum, called with its value: the member; then its name changed.
        "enum-member-state": (
            b"\x80\x04"
            + _u(dcp_md)
            + _u("_MEM_FORMAT_ENCODING")
            + b"\x93K\x00\x85R}"
            + _u("_name_")
            + _u("TORCH_CHANNELS_LAST")
            + b"sb.",
            _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
            "_name_",
        ),
    }


@pytest.mark.parametrize("case", ["class-slot-state", "enum-member-state"])
def test_forged_dcp_metadata_changes_no_class_or_member(tmp_path: Path, case: str) -> None:
    from nvcomp_checkpoint.dcp import read_stored_metadata

    data, target, attr = _metadata_forgeries()[case]
    before = getattr(target, attr, None)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(data)
    try:
        with pytest.raises(FormatError, match="module-level object") as info:
            read_stored_metadata(ckpt)
        assert str(ckpt / ".metadata") in str(info.value)
        assert getattr(target, attr, None) == before
    finally:
        if before is None and hasattr(target, attr):
            delattr(target, attr)
        elif before is not None:
            vars(target)[attr] = before
