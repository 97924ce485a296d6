"""``nvckpt`` on torch.distributed.checkpoint directories: compress / decompress, inspect, verify.

A plain DCP checkpoint written by 2 real gloo ranks (DTensors sharded on a 2-rank mesh) goes
through the CLI into ours and back, bit-identical; inspect shows per-rank-file sizes and the
per-component ratio of both; a damaged or unreadable rank file fails verify, naming the file (and
the tensor), while the other rank files are still listed and checked.
"""

from __future__ import annotations

import json
import shutil
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from fresh_process import spawn_ranks
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.dcp import NvcompReader, is_compressed_dcp_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _full_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16)
    return {
        "model": {"layer": {"weight": w, "bias": torch.randn(64, generator=g)}},
        "optim": {
            "state": {
                "layer.weight": {
                    "exp_avg": torch.randn(64, 48, generator=g) * 1e-3,
                    "exp_avg_sq": torch.rand(64, 48, generator=g) * 1e-6,
                    "step": torch.tensor(12.0),
                }
            }
        },
        "extra": {"epoch": 3, "note": "plain"},
    }


def _sharded(state: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import Shard, distribute_tensor

    if isinstance(state, dict):
        return {k: _sharded(v, mesh) for k, v in state.items()}
    if isinstance(state, torch.Tensor) and state.dim() >= 1:
        return distribute_tensor(state, mesh, [Shard(0)])
    return state


def _save_plain(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        dcp.save(_sharded(_full_state(), mesh), storage_writer=dcp.FileSystemWriter(out))
    finally:
        dist.destroy_process_group()


def _fresh() -> dict[str, Any]:
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.zeros_like, _full_state()) | {"extra": {"epoch": 0, "note": ""}}


def _load(path: Path, reader: Any = None) -> dict[str, Any]:
    state = _fresh()
    dcp.load(state, storage_reader=reader or NvcompReader(path))
    return state


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli_dcp") / "plain"
    spawn_ranks(_save_plain, 2, str(out))
    return out


def _nvckpt(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_compress_and_decompress_round_trip_bit_identical(
    plain_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours, back = tmp_path / "ours", tmp_path / "back"
    code, out = _nvckpt(capsys, "compress", str(plain_dir), str(ours))
    assert code == 0 and "__0_0.distcp" in out and "NvcompReader" in out, out
    assert is_compressed_dcp_checkpoint(ours) and len(list(ours.glob("*.nvcdcp"))) == 2
    code, out = _nvckpt(capsys, "decompress", str(ours), str(back), "--json")
    assert code == 0 and json.loads(out)["format"] == "dcp", out
    assert sorted(p.name for p in back.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    expected = _full_state()
    assert_tree_equal(_load(ours), expected, "ours")
    assert_tree_equal(_load(back, dcp.FileSystemReader(back)), expected, "back, stock reader")
    # Refusals: an existing target, the wrong direction.
    code = main(["compress", str(plain_dir), str(ours)])
    assert code != 0 and "already exists" in capsys.readouterr().err
    code = main(["decompress", str(plain_dir), str(tmp_path / "x")])
    assert code != 0 and "plain DCP checkpoint already" in capsys.readouterr().err
    code = main(["compress", str(ours), str(tmp_path / "y")])
    assert code != 0 and "already a compressed DCP checkpoint" in capsys.readouterr().err
    # --force replaces; --policy re-compresses ours.
    code, _ = _nvckpt(capsys, "compress", str(ours), str(back), "--force", "--policy", "zstd:3")
    assert code == 0 and is_compressed_dcp_checkpoint(back)
    assert_tree_equal(_load(back), expected, "recompressed")


def test_inspect_shows_rank_files_and_component_ratios(
    plain_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compress", str(plain_dir), str(tmp_path / "ours"), "-q"]) == 0
    capsys.readouterr()
    for path, fmt in ((plain_dir, "dcp"), (tmp_path / "ours", "dcp-nvcomp")):
        code, out = _nvckpt(capsys, "inspect", str(path), "--json")
        d = json.loads(out)
        assert code == 0 and d["format"] == fmt
        assert len(d["files"]) == 2 and all(f["file_bytes"] > 0 and f["raw_bytes"] > 0 for f in d["files"])
        comps = d["components"]
        assert {"weights", "exp_avg", "exp_avg_sq"} <= set(comps), comps
        # Every element of the model, once: 64x48 bf16 + 64 fp32 weights.
        assert comps["weights"]["raw_bytes"] == 64 * 48 * 2 + 64 * 4
        code, out = _nvckpt(capsys, "inspect", str(path))
        assert code == 0 and "rank file" in out and "exp_avg_sq" in out and "__1_" in out, out
        # Whole files (indexes, .metadata) in one total, the tensors' frames in the other: named apart.
        assert "total (files)" in out and "total (tensors)" in out and "total (file)" not in out, out
    ours = json.loads(_nvckpt(capsys, "inspect", str(tmp_path / "ours"), "--json")[1])
    plain = json.loads(_nvckpt(capsys, "inspect", str(plain_dir), "--json")[1])
    # bf16 weights have compressible exponents: ours stores them in fewer bytes than the plain files.
    assert ours["components"]["weights"]["stored_bytes"] < plain["components"]["weights"]["stored_bytes"]


def test_verify_passes_good_directories_and_names_damage(
    plain_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = tmp_path / "ours"
    assert main(["compress", str(plain_dir), str(ours), "-q"]) == 0
    for path in (plain_dir, ours):
        code, out = _nvckpt(capsys, "verify", str(path))
        assert code == 0 and "OK" in out and "2 files" in out, out
    # A flipped byte inside a frame of one of our rank files: exit 1, the file and the tensor named.
    damaged = tmp_path / "damaged"
    shutil.copytree(ours, damaged)
    rank_file = sorted(damaged.glob("__1_*.nvcdcp"))[0]
    with nc.open(rank_file) as reader:
        key = next(k for k in reader.keys() if k.startswith("optim.state.layer.weight.exp_avg_sq"))
        frame = reader.entry(key).frames[0]
    data = bytearray(rank_file.read_bytes())
    data[frame.offset + frame.size // 2] ^= 0x10
    rank_file.write_bytes(bytes(data))
    code, out = _nvckpt(capsys, "verify", str(damaged))
    assert code == 1 and rank_file.name in out and "optim.state.layer.weight.exp_avg_sq" in out, out
    # A missing rank file is named too.
    missing = tmp_path / "missing"
    shutil.copytree(ours, missing)
    gone = sorted(missing.glob("__0_*.nvcdcp"))[0]
    gone.unlink()
    code, out = _nvckpt(capsys, "verify", str(missing))
    assert code == 1 and gone.name in out and "missing" in out, out
    # A truncated plain rank file: the tensor whose bytes are cut off is named.
    cut = tmp_path / "cut"
    shutil.copytree(plain_dir, cut)
    victim = cut / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[:-100])
    code, out = _nvckpt(capsys, "verify", str(cut), "--json")
    d = json.loads(out)
    assert code == 1 and not d["ok"] and all(f["file"].endswith("__1_0.distcp") for f in d["failures"]), d
    assert d["failures"][0]["tensor"] and "truncated" in d["failures"][0]["error"], d


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs Linux's /proc, whose files refuse a seek to their end")
def test_a_rank_file_that_does_not_read_is_named_and_the_others_still_listed(
    plain_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nvcomp_checkpoint.dcp import dcp_report, read_dcp_files
    from nvcomp_checkpoint.errors import FormatError

    ours = tmp_path / "ours"
    assert main(["compress", str(plain_dir), str(ours), "-q"]) == 0
    # A rank file whose read fails in the OS (an OSError, not a format error; chmod 000 does not
    # stop root): a link to a /proc file, which refuses the seek to its end that finds the footer.
    broken = tmp_path / "broken"
    shutil.copytree(ours, broken)
    first = sorted(broken.glob("*.nvcdcp"))[0]
    first.unlink()
    first.symlink_to("/proc/version")
    files = read_dcp_files(str(broken))
    assert "cannot be read: OSError" in files.rank_files[0].error and first.name in files.rank_files[0].error
    assert files.rank_files[1].error is None and files.rank_files[1].raw_bytes > 0
    with pytest.raises(FormatError, match=rf"{first.name}: its index does not read \(.*OSError"):
        dcp_report(str(broken))
    code, out = _nvckpt(capsys, "inspect", str(broken), "--json")
    rows = json.loads(out)["files"]
    assert code == 0 and "OSError" in rows[0]["note"] and rows[1]["raw_bytes"] > 0 and "note" not in rows[1], rows
    code, out = _nvckpt(capsys, "verify", str(broken))
    assert code == 1 and f"FAILED {first}: cannot be read: OSError" in out, out
    # A rank file whose header is damaged is no longer one of ours by its first bytes (its footer
    # says it was); verify still names it (and checks the other rank file) instead of passing the directory.
    headless = tmp_path / "headless"
    shutil.copytree(ours, headless)
    victim = sorted(headless.glob("*.nvcdcp"))[1]
    victim.write_bytes(b"\0" * 8 + victim.read_bytes()[8:])
    code, out = _nvckpt(capsys, "verify", str(headless), "--json")
    d = json.loads(out)
    assert code == 1 and d["files"] == 1 and d["tensors"] > 0, d
    assert [(f["file"], f["tensor"]) for f in d["failures"]] == [(str(victim), None)] and "header is damaged" in d["failures"][0][
        "error"
    ], d
