"""DeepSpeed's own readers on a compressed folder: every ``load_checkpoint`` form, ``zero_to_fp32``, ``ds_to_universal``.

One 2-rank CPU run per ZeRO stage (2 and 3) (tests/deepspeed_load_forms.py) saves the same training run with
stock DeepSpeed (``plain``) and attached (``ours``), then loads each folder in every form
``load_checkpoint`` offers, stock engines the plain folder and attached engines ours: what each load
gives must be the same. DeepSpeed's ``zero_to_fp32`` (functions and the script it copies into the
folder) and ``ds_to_universal`` then read our folder through the ``torch.load`` hook and must give
what they give of the plain one; the universal checkpoints load into a world of one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fresh_process
from conftest import assert_tree_equal

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'nvcomp-checkpoint[deepspeed]')")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from nvcomp_checkpoint.deepspeed import deepspeed_torch_load  # noqa: E402
from nvcomp_checkpoint.errors import FormatError  # noqa: E402
from nvcomp_checkpoint.filetype import NVCOMP, TORCH, kind_of  # noqa: E402

SCRIPT = Path(__file__).with_name("deepspeed_load_forms.py")
ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
    "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1] / "src"), str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")]),
}


def _env() -> dict[str, str]:
    return dict(os.environ, **ENV)


def _ranks(world: int, *args: str) -> None:
    proc = fresh_process.run_ranks((str(SCRIPT), *args), world, cwd=os.getcwd(), env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A real interpreter: DeepSpeed's scripts as a user runs them (ds_to_universal forks its workers)."""
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _universal(root: Path, folder: str, through_nvckpt: bool) -> None:
    argv = ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(root / folder / "t3")]
    argv += ["--output_folder", str(root / f"universal-{folder}" / "t3_universal")]
    argv += ["--num_extract_workers", "2", "--num_merge_workers", "1"]
    if through_nvckpt:
        argv = ["-m", "nvcomp_checkpoint.cli", "run", *argv]
    _python(*argv, cwd=root)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """Both folders saved, every load form's results, and the universal checkpoints loaded by one rank."""
    stage = request.param
    root = tmp_path_factory.mktemp(f"ds_forms_zero{stage}")
    _ranks(2, "forms", str(stage), str(root))
    _universal(root, "plain", through_nvckpt=False)
    _universal(root, "ours", through_nvckpt=True)
    _ranks(1, "universal", str(stage), str(root))
    return stage, root


def _kind(path: Path) -> str:
    with open(path, "rb") as f:
        return kind_of(f.read(16), path.stat().st_size)


def test_every_load_form_reads_ours_as_stock_deepspeed_reads_plain(run: tuple[int, Path]) -> None:
    stage, root = run
    assert {_kind(p) for p in (root / "ours" / "t3").glob("*.pt")} == {NVCOMP}
    ref = json.loads((root / "ref.json").read_text())
    for tag in ("t3", "t5"):
        assert ref[tag]["attached"] == ref[tag]["stock"], tag  # the two runs are one run
    forms = json.loads((root / "forms.json").read_text())
    assert set(forms) == {"full-latest", "full-tag", "no-optimizer", "no-optimizer-tag", "module-only", "no-lr-scheduler"}
    for form, loaded in forms.items():
        assert loaded["ours"] == loaded["plain"], form
    # The full loads continue the uninterrupted run; the others load what they say.
    assert forms["full-latest"]["ours"]["losses"] == ref["t5"]["stock"]
    assert forms["full-latest"]["ours"]["path"].startswith("t5" + os.sep)
    assert forms["full-tag"]["ours"]["losses"] == ref["t3"]["stock"]
    assert forms["full-tag"]["ours"]["step"] == 3 and forms["full-tag"]["ours"]["client"] == [["by", "test"]]
    assert forms["no-optimizer"]["ours"]["losses"][0] == ref["t5"]["stock"][0]  # the weights: the first loss
    assert forms["no-optimizer"]["ours"]["losses"][1] != ref["t5"]["stock"][1]  # fresh moments: the next differs
    assert forms["module-only"]["ours"]["step"] == 0
    assert forms["no-lr-scheduler"]["ours"]["losses"][0] == ref["t3"]["stock"][0]
    assert forms["no-lr-scheduler"]["ours"]["scheduler_step"] != forms["full-tag"]["ours"]["scheduler_step"]


def test_zero_to_fp32_functions_read_our_folder_in_the_hook(run: tuple[int, Path], tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
    )

    _, root = run
    for tag in (None, "t3"):
        expected = get_fp32_state_dict_from_zero_checkpoint(str(root / "plain"), tag=tag)
        with deepspeed_torch_load():
            assert_tree_equal(get_fp32_state_dict_from_zero_checkpoint(str(root / "ours"), tag=tag), expected)
    with deepspeed_torch_load():
        convert_zero_checkpoint_to_fp32_state_dict(str(root / "ours"), str(tmp_path / "ours"), safe_serialization=False)
    convert_zero_checkpoint_to_fp32_state_dict(str(root / "plain"), str(tmp_path / "plain"), safe_serialization=False)
    written = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == written and written
    for name in written:
        assert _kind(tmp_path / "ours" / name) == TORCH
        assert_tree_equal(torch.load(tmp_path / "ours" / name), torch.load(tmp_path / "plain" / name))
    # Outside the hook DeepSpeed's torch.load meets the guard: the refusal names DeepSpeed's ways in.
    with pytest.raises(FormatError) as caught:
        get_fp32_state_dict_from_zero_checkpoint(str(root / "ours"))
    message = str(caught.value)
    assert "deepspeed_torch_load" in message and "nvckpt run" in message and "Lightning" not in message, message


def test_zero_to_fp32_script_runs_on_our_folder_through_nvckpt_run(run: tuple[int, Path], tmp_path: Path) -> None:
    _, root = run
    for folder in ("plain", "ours"):
        script = root / folder / "zero_to_fp32.py"  # the copy DeepSpeed puts in every checkpoint folder
        argv = [str(script), str(root / folder), str(tmp_path / folder)]
        _python(*(["-m", "nvcomp_checkpoint.cli", "run", *argv] if folder == "ours" else argv), cwd=tmp_path)
    written = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == written and written
    from safetensors.torch import load_file

    for name in written:
        read = load_file if name.endswith(".safetensors") else torch.load
        assert_tree_equal(read(tmp_path / "ours" / name), read(tmp_path / "plain" / name))


def test_universal_checkpoint_of_our_folder_loads_into_another_world_size(run: tuple[int, Path]) -> None:
    _, root = run
    plain, ours = root / "universal-plain" / "t3_universal", root / "universal-ours" / "t3_universal"
    params = sorted(p.relative_to(plain) for p in plain.rglob("*.pt") if p.parts[-3] == "zero")
    assert params and sorted(p.relative_to(ours) for p in ours.rglob("*.pt") if p.parts[-3] == "zero") == params
    for rel in params:  # ds_to_universal writes the per-parameter files with torch.save: plain in both
        assert _kind(ours / rel) == TORCH
        assert_tree_equal(torch.load(ours / rel, weights_only=False), torch.load(plain / rel, weights_only=False))
    loaded = json.loads((root / "universal.json").read_text())
    assert loaded["ours"] == loaded["plain"]
    ref = json.loads((root / "ref.json").read_text())
    # One rank sees rank 0's batches: its first loss is the 2-rank run's (rank 0's) after t3.
    assert loaded["ours"]["step"] == 3 and loaded["ours"]["losses"][0] == ref["t3"]["stock"][0]
