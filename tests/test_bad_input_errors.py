"""Bad input ends in one of our errors naming the file and what is wrong, on every entry point: JSON nested
a million deep, a manifest that is a directory, ``latest`` naming a missing tag, ``metadata=`` nested too deep."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
from conftest import run_python
from nvcomp_checkpoint.boundedjson import MAX_JSON_DEPTH, MAX_METADATA_DEPTH, json_depth, loads
from nvcomp_checkpoint.cli._ui import EXIT_ERROR
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.deepspeed_layout import (
    MANIFEST_NAME,
    check_tag_complete,
    load_deepspeed_file,
    tag_to_load,
    write_manifest,
)
from nvcomp_checkpoint.dirstore import DirectoryStore
from nvcomp_checkpoint.errors import (
    CheckpointError,
    DeepSpeedTagNotFoundError,
    FormatError,
    NestingLimitError,
    TierUnavailableError,
    UnsupportedObjectError,
)
from nvcomp_checkpoint.format.layout import FOOTER, pack_footer, unpack_footer

#: JSON nested a million deep: what a forged file holds (a RecursionError in json.loads without a bound).
DEEP = b'{"files": ' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}"


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def _cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "this is a bug" not in err and "Traceback" not in err, err
    return code, out + err


# -- the bound -------------------------------------------------------------------------------
def test_json_depth_is_the_nesting_of_arrays_and_objects_outside_strings() -> None:
    for doc in ([1, [2, {"a": "[[[["}]], '[["', {'x"[': [[["\\["]]]}, 5, [], {}, [[[[]]]], _nested(70), "\\"):
        text = json.dumps(doc)
        expected = 0
        stack = [(doc, 1)]
        while stack:  # the nesting counted on the parsed value
            value, level = stack.pop()
            if isinstance(value, (list, dict)):
                expected = max(expected, level)
                stack.extend((v, level + 1) for v in (value.values() if isinstance(value, dict) else value))
        assert json_depth(text) == expected == json_depth(text.encode()), text[:40]


def test_loads_refuses_deeper_than_the_bound_naming_the_file() -> None:
    assert loads(json.dumps(_nested(MAX_JSON_DEPTH - 1)), "f.json") == _nested(MAX_JSON_DEPTH - 1)
    with pytest.raises(NestingLimitError, match=r"^f\.json: the manifest is nested 1000001 levels deep") as info:
        loads(DEEP, "f.json", "manifest")
    assert isinstance(info.value, FormatError) and isinstance(info.value, ValueError)
    # Bytes are read as UTF-8, the only encoding written, so the depth is counted on the very text parsed:
    # json.loads alone would decode UTF-16, where a character's code unit can hold a quote byte.
    hidden = ('["\u2200", ' + "[" * 100_000 + "]" * 100_000 + "]").encode("utf-16-le")
    with pytest.raises(ValueError):  # not JSON, or too deep: never a RecursionError
        loads(hidden, "f.json")


# -- DeepSpeed tags --------------------------------------------------------------------------
def _ds_folder(root: Path) -> Path:
    """A committed DeepSpeed folder of ours: tag t1 (2 ranks, manifest) and ``latest``."""
    tag = root / "t1"
    tag.mkdir(parents=True)
    nc.save({"module": {"w": torch.randn(64)}, "ds_version": "0.19"}, tag / "mp_rank_00_model_states.pt")
    for rank in range(2):
        state = {"optimizer_state_dict": {"single_partition_of_fp32_groups": [torch.randn(32)], "partition_count": [2]}}
        nc.save(state, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    write_manifest(tag, "t1", 2, {p.name: p.stat().st_size for p in tag.iterdir()})
    (root / "latest").write_text("t1")
    return tag


@pytest.mark.parametrize("damage", ["nested-a-million-deep", "a-directory"])
def test_a_damaged_tag_manifest_is_a_format_error_on_every_entry_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    tag = _ds_folder(tmp_path / "ckpt")
    manifest = tag / MANIFEST_NAME
    if damage == "a-directory":
        manifest.unlink()
        manifest.mkdir()
        words = "is a directory"
    else:
        manifest.write_bytes(DEEP)
        words = "nested 1000001 levels deep"
    for call in (lambda: load_deepspeed_file(tag / "mp_rank_00_model_states.pt"), lambda: check_tag_complete(tag)):
        with pytest.raises(FormatError, match=words) as info:
            call()
        assert str(manifest) in str(info.value)
    code, out = _cli(capsys, "verify", tmp_path / "ckpt")
    assert code == 1 and str(manifest) in out  # the "bad checkpoint" exit code, not 3 ("this is a bug")
    code, out = _cli(capsys, "inspect", tmp_path / "ckpt")
    assert code in (0, 1)
    # An in-place conversion leaves the damaged tag as it is, saying why.
    code, out = _cli(capsys, "decompress", tmp_path / "ckpt", "--json")
    assert code == 0 and "skipped" in out and all(nc.is_nvcomp_checkpoint(p) for p in tag.glob("*.pt"))


def test_latest_that_is_a_directory_is_a_format_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _ds_folder(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest").unlink()
    (tmp_path / "ckpt" / "latest").mkdir()
    with pytest.raises(FormatError, match="latest: is a directory"):
        tag_to_load(tmp_path / "ckpt")
    code, out = _cli(capsys, "verify", tmp_path / "ckpt")
    assert code == 1 and "is a directory" in out


def test_latest_naming_a_missing_tag_is_named_with_the_fix(tmp_path: Path) -> None:
    _ds_folder(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest").write_text("global_step9")
    with pytest.raises(DeepSpeedTagNotFoundError) as info:
        tag_to_load(tmp_path / "ckpt")
    message = str(info.value)
    assert str(tmp_path / "ckpt") in message and "'global_step9'" in message and "t1" in message and "tag=" in message
    assert isinstance(info.value, FileNotFoundError)  # as DeepSpeed's callers may catch it
    with pytest.raises(DeepSpeedTagNotFoundError, match="tag='t7'"):
        tag_to_load(tmp_path / "ckpt", "t7")
    assert tag_to_load(tmp_path / "ckpt", "t1") == "t1"
    (tmp_path / "ckpt" / "latest").unlink()
    assert tag_to_load(tmp_path / "ckpt") is None  # no `latest`: DeepSpeed's own warning, nothing loaded


_ENGINE_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed, deepspeed.ops, torch
    from nvcomp_checkpoint.deepspeed import attach

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Linear(8, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    attach(engine)
    root = sys.argv[1]
    engine.save_checkpoint(root, tag="t1")
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("t2")  # a tag removed by hand, or a folder copied without it
    for tag in (None, "t3"):
        try:
            engine.load_checkpoint(root, tag=tag)
        except Exception as exc:
            print("REFUSED:", type(exc).__name__, exc)
        else:
            raise SystemExit("loaded a missing tag")
    path, _ = engine.load_checkpoint(root, tag="t1")
    print("LOADED:", path)
    """
)


def test_attached_engine_names_a_missing_tag_with_the_fix(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    script = tmp_path / "missing_tag.py"
    script.write_text(_ENGINE_SCRIPT)
    out = tmp_path / "out.txt"
    run_python(
        "-c",
        f"import runpy, sys; sys.argv = [{str(script)!r}, {str(tmp_path / 'ckpt')!r}]; "
        f"sys.stdout = open({str(out)!r}, 'w', buffering=1); runpy.run_path({str(script)!r}, run_name='__main__')",
        cwd=tmp_path,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    lines = out.read_text().splitlines()
    refused = [ln for ln in lines if ln.startswith("REFUSED:")]
    assert len(refused) == 2 and all(ln.startswith("REFUSED: DeepSpeedTagNotFoundError") for ln in refused), lines
    assert str(tmp_path / "ckpt") in refused[0] and "'t2'" in refused[0] and "t1" in refused[0] and "tag=" in refused[0]
    assert "'t3'" in refused[1]
    assert any(ln.startswith("LOADED:") and "t1" in ln for ln in lines), lines


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- other manifests and files read as JSON ---------------------------------------------------
@pytest.mark.parametrize("damage", ["nested-a-million-deep", "a-directory"])
def test_a_damaged_unit_manifest_does_not_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    with nc.CheckpointManager([nc.Tier(tmp_path / "tier")], async_save=False) as mgr:
        mgr.save(1, {"w": torch.arange(16.0)})
    (manifest,) = [p for p in (tmp_path / "tier").iterdir() if p.name.endswith(".json")]
    if damage == "a-directory":
        manifest.unlink()
        manifest.mkdir()
        words = "is a directory, not a unit manifest"
    else:
        manifest.write_bytes(DEEP)
        words = "nested 1000001 levels"
    code, out = _cli(capsys, "ls", tmp_path / "tier", "--json")
    assert code == 1 and words in out  # the step does not verify; the tier is listed (not an outage)
    with nc.CheckpointManager([nc.Tier(tmp_path / "tier")], async_save=False) as mgr:
        with pytest.raises(CheckpointError, match=words) as info:
            mgr.restore()
    assert not isinstance(info.value, TierUnavailableError)


def test_a_directory_manifest_nested_a_million_deep_is_a_format_error(tmp_path: Path) -> None:
    store = DirectoryStore("manifest.json", "test-format")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "manifest.json").write_bytes(DEEP)
    with pytest.raises(FormatError, match="nested 1000001 levels"):
        store.read_manifest(tmp_path / "d")
    assert store.read_manifest(tmp_path / "d", quiet=True) is None


def _with_index_metadata(valid: bytes, metadata_json: bytes) -> bytes:
    """``valid`` with its index's metadata replaced by the raw JSON ``metadata_json``; the footer written again."""
    offset, size, _ = unpack_footer(valid[-FOOTER.size :], len(valid), "valid")
    index = valid[offset : offset + size]
    assert index.count(b'"metadata":{') == 1
    start = index.index(b'"metadata":{') + len(b'"metadata":')
    end = start + len(json.dumps(json.loads(index)["metadata"], separators=(",", ":")).encode())
    new_index = index[:start] + metadata_json + index[end:]
    return valid[:offset] + new_index + pack_footer(offset, len(new_index), xxhash.xxh3_64_intdigest(new_index))


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000_000])
def test_an_index_nested_too_deep_is_a_format_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], depth: int) -> None:
    nc.save({"w": torch.arange(16.0)}, tmp_path / "ok.nvc")
    deep = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
    (tmp_path / "deep.nvc").write_bytes(_with_index_metadata((tmp_path / "ok.nvc").read_bytes(), deep))
    for call in (lambda: nc.load(tmp_path / "deep.nvc"), lambda: nc.open(tmp_path / "deep.nvc")):
        with pytest.raises(FormatError, match="nested") as info:
            call()
        assert str(tmp_path / "deep.nvc") in str(info.value)
    code, out = _cli(capsys, "verify", tmp_path / "deep.nvc")
    assert code == 1 and "nested" in out


def test_policy_file_and_safetensors_header_nested_too_deep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"w": torch.arange(16.0)}, tmp_path / "a.pt")
    (tmp_path / "policy.json").write_bytes(DEEP)
    code, out = _cli(capsys, "compress", tmp_path / "a.pt", tmp_path / "a.nvc", "--policy", tmp_path / "policy.json")
    assert code == EXIT_ERROR and "policy.json" in out and "nested" in out
    (tmp_path / "b.safetensors").write_bytes(len(DEEP).to_bytes(8, "little") + DEEP)
    code, out = _cli(capsys, "inspect", tmp_path / "b.safetensors")
    assert code == EXIT_ERROR and "b.safetensors" in out and "nested" in out


# -- metadata= of a save ----------------------------------------------------------------------
@pytest.mark.parametrize("depth", [MAX_METADATA_DEPTH + 1, 1_000])
def test_metadata_nested_too_deep_is_refused_before_anything_is_written(tmp_path: Path, depth: int) -> None:
    state = {"w": torch.arange(16.0)}
    metadata = {"deep": _nested(depth - 1)}
    saves = {
        "save": lambda p: nc.save(state, p, metadata=metadata),
        "save_async": lambda p: nc.save_async(state, p, metadata=metadata).result(),
    }
    for name, save in saves.items():
        target = tmp_path / name / "ckpt.nvc"
        target.parent.mkdir()
        with pytest.raises(UnsupportedObjectError, match=f"nested deeper than {MAX_METADATA_DEPTH} levels") as info:
            save(target)
        assert str(target) in str(info.value)
        assert list(target.parent.iterdir()) == []  # nothing left behind


def test_metadata_at_the_bound_saves_and_loads_back(tmp_path: Path) -> None:
    metadata = {"deep": _nested(MAX_METADATA_DEPTH - 1)}
    nc.save({"w": torch.arange(4.0)}, tmp_path / "a.nvc", metadata=metadata)
    with nc.open(tmp_path / "a.nvc") as reader:
        assert reader.metadata["deep"] == metadata["deep"]
