"""The opt-in ``torch.load`` of our files: ``enable_torch_load``, ``torch_load_reads_nvc``, ``nvckpt run``.

Our files are decoded by our reader with weights-only rules (whatever the caller passes, unless
``trust=True``); every other file goes to the original ``torch.load`` unchanged; the scoped form holds
for its own thread only; the global form is undone by ``disable_torch_load``. Without either, the
guard's refusal leads with the opt-in, and names DeepSpeed's ways in when DeepSpeed is the caller.
"""

from __future__ import annotations

import io
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import FormatError, UnsafeCheckpointError
from nvcomp_checkpoint.format import guard


class Point:
    """A class outside torch's allow-list: weights-only loads refuse it."""

    def __init__(self, x: int) -> None:
        self.x = x


def _tree() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(16, 8), "b": torch.zeros(8, dtype=torch.bfloat16)}, "step": 7, "names": ["a", "b"]}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    tree = _tree()
    nc.save(tree, tmp_path / "full.nvc")
    tree["model"]["w"] = tree["model"]["w"] + 1e-3
    nc.save(tree, tmp_path / "delta.nvc", base=tmp_path / "full.nvc")
    torch.save(tree, tmp_path / "plain.pt")
    nc.save({"w": torch.ones(2), "point": Point(3)}, tmp_path / "object.nvc")
    return {
        "full": tmp_path / "full.nvc",
        "delta": tmp_path / "delta.nvc",
        "plain": tmp_path / "plain.pt",
        "object": tmp_path / "object.nvc",
    }


@pytest.fixture(autouse=True)
def _torch_load_restored():
    original = torch.load
    yield
    nc.disable_torch_load()
    assert torch.load is original


def test_scope_reads_our_files_by_path_stream_and_bytes(files: dict[str, Path]) -> None:
    original = torch.load
    with nc.torch_load_reads_nvc():
        assert torch.load is not original
        for kind in ("full", "delta"):
            assert_tree_equal(torch.load(files[kind]), nc.load(files[kind]))
            assert_tree_equal(
                torch.load(str(files[kind]), map_location="cpu", weights_only=False, mmap=True), nc.load(files[kind])
            )
        with open(files["delta"], "rb") as f:  # a file object: read by its path, so a delta finds its base
            assert_tree_equal(torch.load(f), nc.load(files["delta"]))
        data = io.BytesIO(files["full"].read_bytes())
        assert_tree_equal(torch.load(data, map_location=torch.device("cpu")), nc.load(files["full"]))
        # torch.load's own files go to torch.load as they are.
        assert_tree_equal(torch.load(files["plain"]), torch.load.__wrapped__(files["plain"]))  # type: ignore[attr-defined]
        with pytest.raises(FileNotFoundError):
            torch.load(files["plain"].with_name("missing.pt"))
    assert torch.load is original
    with pytest.raises(pickle.UnpicklingError):
        torch.load(files["full"])


def test_our_files_are_read_weights_only_unless_trusted(files: dict[str, Path]) -> None:
    with nc.torch_load_reads_nvc():
        with pytest.raises(UnsafeCheckpointError, match="Point") as caught:
            torch.load(files["object"], weights_only=False)  # the caller's False does not open our files to pickle
        # The refusal says what works through the hook (the caller's weights_only=False does not).
        assert "add_safe_globals" in str(caught.value) and "trust=True" in str(caught.value)
        # torch's own allow-list is honoured, as in torch.load(weights_only=True).
        with torch.serialization.safe_globals([Point]):
            assert torch.load(files["object"])["point"].x == 3
    with nc.torch_load_reads_nvc(trust=True):
        assert torch.load(files["object"], weights_only=False)["point"].x == 3
        with pytest.raises(UnsafeCheckpointError, match="Point"):
            torch.load(files["object"])  # trust honours weights_only=False only where the caller passes it


def test_scope_holds_for_its_own_thread_only(files: dict[str, Path]) -> None:
    seen: list[str] = []

    def other() -> None:
        try:
            torch.load(files["full"])
            seen.append("read")
        except pickle.UnpicklingError:
            seen.append("refused")

    with nc.torch_load_reads_nvc():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        torch.load(files["full"])
    assert seen == ["refused"]
    nc.enable_torch_load()  # process-wide: every thread
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == ["refused", "read"]


def test_enable_and_disable_are_reversible_and_nest_with_scopes(files: dict[str, Path]) -> None:
    original = torch.load
    nc.enable_torch_load()
    nc.enable_torch_load()  # again: still one wrapper
    wrapper = torch.load
    assert torch.load(files["full"])["step"] == 7
    with nc.torch_load_reads_nvc():
        nc.disable_torch_load()
        assert torch.load is wrapper  # the open scope keeps it
        assert torch.load(files["full"])["step"] == 7
    assert torch.load is original
    # Another library that wraps torch.load over ours keeps its wrapper; ours passes its calls through.
    nc.enable_torch_load()
    calls: list[object] = []

    def theirs(f: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(f)
        return wrapper(f, *args, **kwargs)

    torch.load = theirs
    try:
        nc.disable_torch_load()
        assert torch.load is theirs
        with pytest.raises(pickle.UnpicklingError):
            torch.load(files["full"])
        assert torch.load(files["plain"])["step"] == 7 and len(calls) == 2
    finally:
        torch.load = original


def test_lightning_load_from_checkpoint_reads_our_file(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")

    class Model(pl.LightningModule):
        def __init__(self, width: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(width, 2)

    model = Model(width=6)
    checkpoint = {
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
        "pytorch-lightning_version": pl.__version__,
    }
    nc.save(checkpoint, tmp_path / "model.ckpt")
    with pytest.raises(pickle.UnpicklingError):
        Model.load_from_checkpoint(tmp_path / "model.ckpt")
    nc.enable_torch_load()
    loaded = Model.load_from_checkpoint(tmp_path / "model.ckpt")  # Lightning opens it as an fsspec stream
    assert loaded.hparams.width == 6
    assert_tree_equal(loaded.state_dict(), model.state_dict())


def _load_as(module: str, path: Path) -> BaseException:
    """``torch.load(path, weights_only=False)`` called from code whose module is ``module``."""
    code = compile("torch.load(path, weights_only=False)", f"<{module}>", "exec")
    with pytest.raises(FormatError) as caught:
        exec(code, {"__name__": module, "torch": torch, "path": path})  # noqa: S102 - the caller's module name is the point
    return caught.value


def test_refusal_leads_with_the_opt_in_and_names_deepspeeds_ways_in(files: dict[str, Path]) -> None:
    message = str(_load_as("evaluate", files["full"]))
    assert message == guard.MESSAGE
    assert message.index("enable_torch_load()") < message.index("nvcomp_checkpoint.load(path)")
    for module in ("deepspeed.utils.zero_to_fp32", "deepspeed.checkpoint.ds_to_universal"):
        message = str(_load_as(module, files["full"]))
        assert message == guard.DEEPSPEED_MESSAGE and "Lightning" not in message
        assert "deepspeed_torch_load()" in message and "nvckpt run" in message and "attach(engine)" in message


def _cli(*argv: str) -> int:
    from nvcomp_checkpoint.cli.main import main

    return main(list(argv))


def test_nvckpt_run_runs_a_script_whose_torch_load_reads_ours(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = torch.load
    script = tmp_path / "evaluate.py"
    script.write_text(
        "import sys, torch\n"
        "tree = torch.load(sys.argv[1], map_location='cpu', weights_only=False)\n"
        "print('keys', sorted(tree), sys.argv[2:])\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    assert _cli("run", str(script), str(files["delta"]), "0", "--flag") == 0
    assert "keys ['model', 'names', 'step'] ['0', '--flag']" in capsys.readouterr().out
    assert torch.load is original
    assert _cli("run", str(script), str(files["plain"]), "3") == 3
    # The script's own failure: its traceback, exit status 1, as python gives.
    assert _cli("run", str(script), str(files["object"]), "0") == 1
    err = capsys.readouterr().err
    assert "UnsafeCheckpointError" in err and "pass --trust" in err
    assert _cli("run", "--trust", str(script), str(files["object"]), "0") == 0
    assert "keys ['point', 'w']" in capsys.readouterr().out
    assert _cli("run", str(tmp_path / "missing.py")) == 2
    assert "no such script" in capsys.readouterr().err
    assert torch.load is original


def test_a_foreign_class_in_deepspeeds_torch_load_is_refused_naming_deepspeed_and_the_fix(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'nvcomp-checkpoint[deepspeed]')")
    from nvcomp_checkpoint.deepspeed import deepspeed_torch_load
    from nvcomp_checkpoint.deepspeed_layout import write_manifest

    tag = tmp_path / "t1"
    tag.mkdir()
    nc.save({"module": {"w": torch.ones(2)}, "extra": Point(1)}, tag / "mp_rank_00_model_states.pt")
    write_manifest(tag, "t1", 1, {p.name: p.stat().st_size for p in tag.iterdir()})
    with deepspeed_torch_load():
        with pytest.raises(UnsafeCheckpointError, match="Point") as caught:
            torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)  # as DeepSpeed calls it
    message = str(caught.value)
    assert "DeepSpeed" in message and "add_safe_globals" in message and "Lightning" not in message, message
