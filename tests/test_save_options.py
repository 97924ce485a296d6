"""One save's options travel as one frozen, keyword-only value: ``metadata`` and ``storage_options`` cannot trade places."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.api import write_checkpoint
from nvcomp_checkpoint.async_save import AsyncSaver
from nvcomp_checkpoint.errors import UnsupportedObjectError
from nvcomp_checkpoint.savegroup import SaveSequence
from nvcomp_checkpoint.saveoptions import SaveOptions

SECRET = "AKIA-do-not-store-" + uuid.uuid4().hex
CREDENTIALS = {"key": SECRET, "secret": SECRET, "client_kwargs": {"endpoint_url": "http://" + SECRET}}


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4096, dtype=torch.float32)}


def test_options_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        SaveOptions(nc.CodecPolicy(), {"note": "x"}, CREDENTIALS)  # type: ignore[misc]
    options = SaveOptions.of("x.nvc", "save", metadata={"note": "x"}, storage_options=CREDENTIALS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.metadata = CREDENTIALS  # type: ignore[misc]
    assert SECRET not in repr(options)  # logs and tracebacks never show credentials


def test_write_checkpoint_takes_one_options_value_by_keyword(tmp_path: Path) -> None:
    # Below the public API the options are one value: the old positional (metadata, storage_options)
    # pair, where a swap type-checked and wrote credentials into the index, is refused.
    with pytest.raises(TypeError):
        write_checkpoint(_state(), tmp_path / "a.nvc", None, CREDENTIALS, {"note": "x"}, None, None, None)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        write_checkpoint(_state(), tmp_path / "a.nvc", SaveOptions())  # type: ignore[misc]
    report = write_checkpoint(_state(), tmp_path / "a.nvc", options=SaveOptions.of(tmp_path / "a.nvc", "save"))
    assert report.stored_bytes > 0


@pytest.mark.parametrize(
    ("keywords", "error", "names"),
    [
        ({"workers": 0}, ValueError, "workers must be a positive int"),
        ({"workers": True}, TypeError, "workers must be a positive int"),
        ({"workers": 2.0}, TypeError, "workers must be a positive int"),
        ({"metadata": [("a", 1)]}, TypeError, "save(metadata=...) must be a dict"),
        ({"metadata": {"a": object()}}, UnsupportedObjectError, "metadata must be JSON"),
        ({"storage_options": "anon=True"}, TypeError, "save(storage_options=...) must be a dict"),
        ({"policy": 3}, TypeError, "save(policy=...)"),
        ({"base_state": {"w": 1}}, ValueError, "pass base= too"),
    ],
)
def test_every_keyword_is_checked_where_the_value_is_built(keywords: dict[str, Any], error: type, names: str) -> None:
    with pytest.raises(error) as info:
        SaveOptions.of("x.nvc", "save", **keywords)
    assert names in str(info.value)


def test_public_save_checks_workers_before_writing(tmp_path: Path) -> None:
    for save in (nc.save, nc.save_async):
        with pytest.raises(ValueError, match="workers must be a positive int"):
            save(_state(), tmp_path / "a.nvc", workers=0)
    assert not (tmp_path / "a.nvc").exists()
    # Where workers is a setting, it is checked when the setting is made, not at the first save.
    from nvcomp_checkpoint.lightning import NvcompCheckpointIO

    for make in (AsyncSaver, NvcompCheckpointIO, lambda **kw: nc.CheckpointManager([nc.Tier(tmp_path / "t0")], **kw)):
        with pytest.raises(ValueError, match="workers must be a positive int"):
            make(workers=0)


def test_credentials_in_storage_options_never_reach_the_file(tmp_path: Path) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    meta = {"note": "kept"}
    nc.save(_state(), f"{url}/sync.nvc", metadata=meta, storage_options=CREDENTIALS)
    nc.save_async(_state(), f"{url}/async.nvc", metadata=meta, storage_options=CREDENTIALS).result()
    seq = SaveSequence("test", max_pending=1)
    try:
        group = seq.begin(f"{url}/group.nvc")
        options = SaveOptions.of(f"{url}/group.nvc", "save", metadata=meta, storage_options=CREDENTIALS)
        seq.save(group, "part", _state(), f"{url}/group.nvc", options)
        seq.seal(group)
        seq.result(group)
    finally:
        seq.close()
    fs = fsspec.filesystem("memory")
    for name in ("sync.nvc", "async.nvc", "group.nvc"):
        raw = fs.cat_file(f"{url}/{name}")
        assert SECRET.encode() not in raw, name
        with nc.open(f"{url}/{name}", storage_options=CREDENTIALS) as reader:
            assert reader.metadata["note"] == "kept"
            assert SECRET not in repr(reader.metadata)
        assert torch.equal(nc.load(f"{url}/{name}")["w"], _state()["w"])


def test_async_saver_and_sequence_take_the_options_value(tmp_path: Path) -> None:
    with AsyncSaver() as saver:
        with pytest.raises(TypeError):
            saver.submit(_state(), tmp_path / "a.nvc", policy="zstd:3")  # type: ignore[call-arg]
        handle = saver.submit(_state(), tmp_path / "a.nvc", SaveOptions.of(tmp_path / "a.nvc", "save", policy="zstd:3"))
        handle.result()
    with nc.open(tmp_path / "a.nvc") as reader:
        assert reader.entry("w").codec.level == 3
