"""Sharded checkpoints through torch.distributed.checkpoint with NvcompWriter / NvcompReader.

Real multi-process runs (gloo on the CPU, spawned ranks, FSDP2 ``fully_shard``): save on 2
ranks, load on 2, 3 and 1 (no process group); async save; a rank killed mid-save; a flipped
byte; plain DCP checkpoints read by NvcompReader and ours refused by a stock reader.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from fresh_process import spawn_ranks
from nvcomp_checkpoint.dcp import NvcompReader, NvcompWriter, fqn_component, is_compressed_dcp_checkpoint
from nvcomp_checkpoint.errors import CheckpointError, ChecksumError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# -- helpers shared by the ranks and the test process ------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 48 and 40 rows shard unevenly over 3 ranks (resharding crosses shard boundaries); the 2 rows
    # of the last layer leave the third rank an empty shard.
    return torch.nn.Sequential(
        torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 2)
    )


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int) -> list[float]:
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 24, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, full: bool = False) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    return {"model": msd, "optim": osd, "extra": {"step": 7, "note": "sharded"}}


def _fresh_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    # Optimizer state exists only after a step: take one with zero lr so the model is unchanged,
    # then overwrite everything from the checkpoint.
    return _state(model, opt) | {"extra": {"step": 0, "note": ""}}


def _sharded(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _tensor_parallel(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _plain() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _with_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        group["lr"], lr = 0.0, group["lr"]
    _train(model, opt, 1, rank=99)
    for group in opt.param_groups:
        group["lr"] = lr


def _load_into(model: torch.nn.Module, opt: torch.optim.Optimizer, reader: Any) -> dict[str, Any]:
    _with_optimizer_state(model, opt)
    state = _fresh_state(model, opt)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    # Cloned: unsharded tensors (the optimizer's step) are the live ones, changed by training.
    full = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, _state(model, opt, full=True))
    return full | {"extra": extra}


def _spawn(fn: Any, world: int, *args: Any) -> None:
    spawn_ranks(_rank_main, world, fn, args)


def _rank_main(rank: int, world: int, port: int, fn: Any, args: tuple[Any, ...]) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


# -- what the ranks do ---------------------------------------------------------------------------
def _save_on_two(rank: int, world: int, tmp: str) -> None:
    root = Path(tmp)
    model, opt = _sharded(world)
    _train(model, opt, 2, rank)
    state = _state(model, opt)
    dcp.save(state, storage_writer=NvcompWriter(root / "ours"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(root / "plain"))
    # Without collectives: each rank plans, writes and commits (its __<rank>.metadata) alone.
    dcp.save(state, storage_writer=NvcompWriter(root / "nocoll"), use_collectives=False)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(root / "nocoll_plain"), use_collectives=False)
    with pytest.raises(CheckpointError, match="needs a new directory per checkpoint"):
        dcp.save(state, storage_writer=NvcompWriter(root / "nocoll"), use_collectives=False)
    # Save "s1" loses rank 1's commit; a retry "s2" into the same directory commits only rank 1's
    # part (rank 0's own metadata is there): the tags tell the two saves apart.
    dcp.save(state, storage_writer=NvcompWriter(root / "mixed", save_tag="s1"), use_collectives=False)
    dist.barrier()
    if rank == 1:
        (root / "mixed" / "__1.metadata").unlink()
    dist.barrier()
    if rank == 0:
        with pytest.raises(CheckpointError, match="needs a new directory per checkpoint"):
            dcp.save(state, storage_writer=NvcompWriter(root / "mixed", save_tag="s2"), use_collectives=False)
        dist.barrier()  # the one rank 1's dcp.save ends with
    else:
        dcp.save(state, storage_writer=NvcompWriter(root / "mixed", save_tag="s2"), use_collectives=False)
    full = _full(model, opt, state["extra"])
    if rank == 0:
        torch.save(full, root / "ref.pt")
    # A further step, then an async save of the changed state.
    _train(model, opt, 1, rank)
    state = _state(model, opt)
    dcp.async_save(state, storage_writer=NvcompWriter(root / "async")).result()
    full_async = _full(model, opt, state["extra"])  # a collective: every rank takes part
    if rank == 0:
        torch.save(full_async, root / "ref_async.pt")
    # Staged on the tensors' own device (here the CPU; on a GPU, a clone there that the background
    # save compresses with nvCOMP): training that goes on meanwhile must not reach the checkpoint.
    # The save's collectives run on a group of their own, beside training's.
    save_group = dist.new_group(backend="gloo")
    late = lambda stream: (time.sleep(1.0), stream)[1]  # noqa: E731 - the write starts once training went on
    writer = NvcompWriter(root / "async_device", staging="device", stream_wrapper=late)
    pending = dcp.async_save(state, storage_writer=writer, process_group=save_group)
    _train(model, opt, 1, rank)
    pending.result()
    trained_on = _full(model, opt, state["extra"])["model"]  # a collective; rank 0 gets the full tensors
    if rank == 0:
        assert any(not torch.equal(trained_on[k], full_async["model"][k]) for k in trained_on), "training went on"
    dist.barrier()

    # A tensor-parallel layout: the first layer's rows and the second's columns split (Shard(0), Shard(1)).
    tp_model, tp_opt = _tensor_parallel(world)
    _train(tp_model, tp_opt, 1, 0)  # every rank sees the same batch, as tensor parallelism needs
    tp_state = _state(tp_model, tp_opt)
    dcp.save(tp_state, storage_writer=NvcompWriter(root / "tp"))
    tp_full = _full(tp_model, tp_opt, tp_state["extra"])
    if rank == 0:
        torch.save(tp_full, root / "ref_tp.pt")

    # Round trips on 2 ranks, from ours and from the plain checkpoint, into fresh models.
    for name in ("ours", "plain", "nocoll", "nocoll_plain"):
        fresh, fresh_opt = _sharded(world)
        loaded = _load_into(fresh, fresh_opt, NvcompReader(root / name))
        got = _full(fresh, fresh_opt, loaded["extra"])
        if rank == 0:
            assert_tree_equal(got, full, name)

    # Rank 1's file replaced by rank 1's file of a later checkpoint, under the expected name (valid
    # in itself, every checksum holds): the load is refused on both ranks, none gets a mix.
    dcp.save(state, storage_writer=NvcompWriter(root / "later"))
    dist.barrier()
    if rank == 0:
        shutil.copytree(root / "ours", root / "mixed_files")
        mine = sorted((root / "mixed_files").glob("__1_*.nvcdcp"))[0]
        shutil.copyfile(sorted((root / "later").glob("__1_*.nvcdcp"))[0], mine)
    dist.barrier()
    fresh, fresh_opt = _sharded(world)
    with pytest.raises(CheckpointException) as info:
        _load_into(fresh, fresh_opt, NvcompReader(root / "mixed_files"))
    assert "not the rank file this checkpoint's metadata names" in str(info.value) and "__1_" in str(info.value)


def _reshard_to_three(rank: int, world: int, tmp: str) -> None:
    root = Path(tmp)
    ref = torch.load(root / "ref.pt", weights_only=True)
    model, opt = _sharded(world)
    loaded = _load_into(model, opt, NvcompReader(root / "ours"))
    got = _full(model, opt, loaded["extra"])
    if rank == 0:
        assert_tree_equal(got, ref, "2->3")
    # Saved on 3 ranks in turn (loaded 3 -> 1 by the test process).
    dcp.save(_state(model, opt), storage_writer=NvcompWriter(root / "ours3"))

    # A ShardedTensor (FSDP1's sharded state dict) whose rank 0 holds two chunks of it.
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:0/cpu"])
    st = sharded_tensor.empty(spec, 10, 6)
    for shard in st.local_shards():
        offset = shard.metadata.shard_offsets[0]
        rows = shard.tensor.shape[0]
        shard.tensor.copy_(_sharded_tensor_value()[offset : offset + rows])
    dcp.save({"st": st}, storage_writer=NvcompWriter(root / "sharded_tensor"))
    # Staged on its device (the CPU here): the ShardedTensor keeps its layout; a later change stays out.
    late = lambda stream: (time.sleep(0.5), stream)[1]  # noqa: E731
    pending = dcp.async_save(
        {"st": st}, storage_writer=NvcompWriter(root / "sharded_tensor_device", staging="device", stream_wrapper=late)
    )
    for shard in st.local_shards():
        shard.tensor.add_(1)
    pending.result()


def _sharded_tensor_value() -> torch.Tensor:
    return torch.arange(60, dtype=torch.float64).reshape(10, 6) / 8  # exact in any thread count


def _killed_mid_save(rank: int, world: int, tmp: str) -> None:
    root = Path(tmp)
    model, opt = _sharded(world)
    _train(model, opt, 2, rank)
    dcp.save(_state(model, opt), storage_writer=NvcompWriter(root / "prev"))
    full = _full(model, opt, {"step": 7, "note": "sharded"})
    if rank == 0:
        torch.save(full, root / "ref_prev.pt")
    dist.barrier()
    _train(model, opt, 1, rank)

    class _DieAfterFirstWrite:
        def __init__(self, raw: Any) -> None:
            self.raw = raw

        def write(self, data: Any) -> int:
            n = self.raw.write(data)
            self.raw.flush()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return n

    dcp.save(_state(model, opt), storage_writer=NvcompWriter(root / "new", stream_wrapper=_DieAfterFirstWrite))


# -- tests ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints saved by a 2-rank FSDP2 run (ours, plain DCP, async), with full references."""
    root = tmp_path_factory.mktemp("dcp2")
    _spawn(_save_on_two, 2, str(root))
    return root


def test_two_rank_save_loads_on_two_ranks_and_files_are_ours(two_rank_run: Path) -> None:
    # The round trips on 2 ranks ran (and asserted) inside the spawned run; here, the layout.
    files = sorted(p.name for p in (two_rank_run / "ours").iterdir())
    assert files[0] == ".metadata" and len(files) == 3 and all(f.endswith(".nvcdcp") for f in files[1:])
    assert is_compressed_dcp_checkpoint(two_rank_run / "ours")
    assert not is_compressed_dcp_checkpoint(two_rank_run / "plain")
    with nc.open(two_rank_run / "ours" / files[1]) as reader:
        summary = reader.summary()
        assert {"weights", "exp_avg", "exp_avg_sq"} <= set(summary)
        assert reader.entry("optim.state.0.weight.exp_avg_sq").component == "exp_avg_sq"


def test_two_ranks_to_one_without_process_group(two_rank_run: Path) -> None:
    ref = torch.load(two_rank_run / "ref.pt", weights_only=True)
    model, opt = _plain()
    loaded = _load_into(model, opt, NvcompReader(two_rank_run / "ours"))
    assert_tree_equal(_full(model, opt, loaded["extra"]), ref, "2->1")


def test_save_without_collectives_commits_per_rank_and_loads_anywhere(two_rank_run: Path, tmp_path: Path) -> None:
    # 2 -> 2 ran in the spawned run; here 2 -> 1 without a process group, ours and plain.
    files = sorted(p.name for p in (two_rank_run / "nocoll").iterdir())
    assert [f for f in files if not f.endswith(".nvcdcp")] == ["__0.metadata", "__1.metadata"] and len(files) == 4, files
    assert is_compressed_dcp_checkpoint(two_rank_run / "nocoll")
    ref = torch.load(two_rank_run / "ref.pt", weights_only=True)
    for name in ("nocoll", "nocoll_plain"):
        model, opt = _plain()
        loaded = _load_into(model, opt, NvcompReader(two_rank_run / name))
        assert_tree_equal(_full(model, opt, loaded["extra"]), ref, f"{name} 2->1")
    # Converted, it becomes an ordinary checkpoint (one .metadata), loadable by the stock reader.
    from nvcomp_checkpoint.dcp import compress_directory, decompress_directory

    compress_directory(two_rank_run / "nocoll_plain", tmp_path / "converted")
    decompress_directory(two_rank_run / "nocoll", tmp_path / "plain_again")
    for reader in (NvcompReader(tmp_path / "converted"), dcp.FileSystemReader(tmp_path / "plain_again")):
        model, opt = _plain()
        loaded = _load_into(model, opt, reader)
        assert_tree_equal(_full(model, opt, loaded["extra"]), ref, f"{type(reader).__name__} converted 2->1")
    # Rank 1 never committed: the directory refuses to load, naming the missing file.
    partial = tmp_path / "partial"
    shutil.copytree(two_rank_run / "nocoll", partial)
    (partial / "__1.metadata").unlink()
    model, opt = _plain()
    with pytest.raises(CheckpointException, match=r"__1\.metadata: missing.*rank 1 never committed"):
        _load_into(model, opt, NvcompReader(partial))
    # A retry into a directory a save left incomplete: the parts of two saves are refused.
    with pytest.raises(CheckpointException, match=r"save_tag 's2', __0\.metadata has 's1': the directory mixes"):
        _load_into(model, opt, NvcompReader(two_rank_run / "mixed"))
    # A plain one missing a rank's part: caught by the shards' coverage.
    partial = tmp_path / "partial_plain"
    shutil.copytree(two_rank_run / "nocoll_plain", partial)
    (partial / "__1.metadata").unlink()
    with pytest.raises(CheckpointException, match="saved only in part"):
        _load_into(model, opt, NvcompReader(partial))


def test_tensor_parallel_layout_loads_on_one_process(two_rank_run: Path) -> None:
    ref = torch.load(two_rank_run / "ref_tp.pt", weights_only=True)
    model, opt = _plain()
    loaded = _load_into(model, opt, NvcompReader(two_rank_run / "tp"))
    assert_tree_equal(_full(model, opt, loaded["extra"]), ref, "tensor parallel 2->1")


def test_async_save_loads_bit_identical(two_rank_run: Path) -> None:
    ref = torch.load(two_rank_run / "ref_async.pt", weights_only=True)
    for name in ("async", "async_device"):
        model, opt = _plain()
        loaded = _load_into(model, opt, NvcompReader(two_rank_run / name))
        assert_tree_equal(_full(model, opt, loaded["extra"]), ref, name)


@pytest.fixture(scope="module")
def three_rank_run(two_rank_run: Path) -> Path:
    """The two-rank checkpoint loaded on three ranks, which save it again (and a ShardedTensor)."""
    _spawn(_reshard_to_three, 3, str(two_rank_run))
    return two_rank_run


def test_two_ranks_to_three_and_three_to_one(three_rank_run: Path) -> None:
    two_rank_run = three_rank_run
    assert len([p for p in (two_rank_run / "ours3").iterdir() if p.suffix == ".nvcdcp"]) == 3
    ref = torch.load(two_rank_run / "ref.pt", weights_only=True)
    model, opt = _plain()
    loaded = _load_into(model, opt, NvcompReader(two_rank_run / "ours3"))
    assert_tree_equal(_full(model, opt, loaded["extra"]), ref, "3->1")


def test_sharded_tensor_with_two_chunks_on_a_rank_loads_on_one_process(three_rank_run: Path) -> None:
    two_rank_run = three_rank_run
    files = sorted((two_rank_run / "sharded_tensor").glob("__0_*.nvcdcp"))
    assert len(files) == 1
    with nc.open(files[0]) as reader:
        assert sorted(reader.keys()) == ["st", "st@9,0"]  # the second chunk of rank 0, by its offsets
    for name in ("sharded_tensor", "sharded_tensor_device"):
        state = {"st": torch.zeros(10, 6, dtype=torch.float64)}
        dcp.load(state, storage_reader=NvcompReader(two_rank_run / name))
        assert torch.equal(state["st"], _sharded_tensor_value()), name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"staging": "gpu"}, "choose 'host' or 'device'"),
        ({"staging": "device", "cache_staged_state_dict": True}, "Pass one of them"),
        ({"staging": "device", "device_budget_bytes": -1}, "must be >= 0"),
    ],
)
def test_staging_options_are_checked(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NvcompWriter(tmp_path, **kwargs)


def test_stock_reader_is_told_to_use_nvcomp_reader(two_rank_run: Path) -> None:
    model, opt = _plain()
    _with_optimizer_state(model, opt)
    with pytest.raises(CheckpointException) as info:
        dcp.load(_fresh_state(model, opt), storage_reader=dcp.FileSystemReader(two_rank_run / "ours"))
    assert "nvcomp_checkpoint.dcp.NvcompReader" in str(info.value)


def test_flipped_byte_names_fqn_and_file(two_rank_run: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(two_rank_run / "ours", damaged)
    rank_file = sorted(damaged.glob("__1_*.nvcdcp"))[0]
    with nc.open(rank_file) as reader:
        frame = reader.entry("model.2.weight").frames[0]
    data = bytearray(rank_file.read_bytes())
    data[frame.offset + frame.size // 2] ^= 0x10
    rank_file.write_bytes(bytes(data))
    model, opt = _plain()
    with pytest.raises(CheckpointException) as info:
        _load_into(model, opt, NvcompReader(damaged))
    ((error, _),) = info.value.failures.values()
    assert isinstance(error, ChecksumError)
    assert "'model.2.weight'" in str(error) and str(rank_file) in str(error)


def test_rank_killed_mid_save_leaves_a_directory_that_refuses_to_load(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessExitedException):
        _spawn(_killed_mid_save, 2, str(tmp_path))
    assert not (tmp_path / "new" / ".metadata").exists()
    model, opt = _plain()
    with pytest.raises(CheckpointException) as info:
        _load_into(model, opt, NvcompReader(tmp_path / "new"))
    assert "never completed" in str(info.value)
    ref = torch.load(tmp_path / "ref_prev.pt", weights_only=True)
    model, opt = _plain()
    loaded = _load_into(model, opt, NvcompReader(tmp_path / "prev"))
    assert_tree_equal(_full(model, opt, loaded["extra"]), ref, "previous")


# -- single process (no process group) -----------------------------------------------------------
def test_failed_save_into_a_checkpoint_directory_keeps_that_checkpoint(tmp_path: Path) -> None:
    model, opt = _plain()
    _train(model, opt, 1, 0)
    dcp.save(_state(model, opt), storage_writer=NvcompWriter(tmp_path))
    ref = _full(model, opt, {"step": 7, "note": "sharded"})
    old_files = {p.name for p in tmp_path.iterdir()}
    _train(model, opt, 1, 0)

    class _Fail:
        def __init__(self, raw: Any) -> None:
            self.raw = raw

        def write(self, data: Any) -> int:
            raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointException):
        dcp.save(_state(model, opt), storage_writer=NvcompWriter(tmp_path, stream_wrapper=_Fail))
    assert {p.name for p in tmp_path.iterdir()} == old_files
    fresh, fresh_opt = _plain()
    loaded = _load_into(fresh, fresh_opt, NvcompReader(tmp_path))
    assert_tree_equal(_full(fresh, fresh_opt, loaded["extra"]), ref, "kept")
    # A save that succeeds replaces the checkpoint and removes the files it no longer uses; one
    # writer used for two saves names its files afresh each time.
    writer = NvcompWriter(tmp_path)
    dcp.save(_state(model, opt), storage_writer=writer)
    first = {p.name for p in tmp_path.iterdir()}
    dcp.save(_state(model, opt), storage_writer=writer)
    names = {p.name for p in tmp_path.iterdir()}
    assert len(first) == len(names) == 2 and not (names & (old_files | first) - {".metadata"})


def test_fqn_classification() -> None:
    assert fqn_component("model.layers.0.attn.weight").value == "weights"
    assert fqn_component("optim.state.layers.0.attn.weight.exp_avg").value == "exp_avg"
    assert fqn_component("optimizer_0.state.layer.weight.exp_avg_sq").value == "exp_avg_sq"
    assert fqn_component("optim.state.layer.weight.step").value == "other"
    assert fqn_component("state_dict.layer.weight").value == "weights"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "ckpt: does not exist; check the path"),
        (
            lambda p: nc.save({"w": torch.ones(3)}, p),
            "ckpt: a single-file checkpoint of nvcomp-checkpoint, not a DCP directory: use nvcomp_checkpoint.load(path)",
        ),
        (
            lambda p: torch.save({"w": torch.ones(3)}, p),
            "ckpt: a torch.save file, not a DCP directory: use nvcomp_checkpoint.load(path) or torch.load(path)",
        ),
        (lambda p: p.mkdir(), "ckpt: an empty directory: no checkpoint was saved here"),
        (
            lambda p: (p.mkdir(), (p / "__0_0.distcp").write_bytes(b"x")),
            "ckpt: a directory without .metadata (nor __0.metadata): not a DCP checkpoint, or a save that never completed",
        ),
    ],
    ids=["absent", "single-file", "torch-save-file", "empty-directory", "uncommitted-directory"],
)
def test_reader_says_what_is_at_a_path_that_holds_no_dcp_checkpoint(tmp_path: Path, make: Any, message: str) -> None:
    make(tmp_path / "ckpt")
    model, opt = _plain()
    with pytest.raises(CheckpointException) as info:
        _load_into(model, opt, NvcompReader(tmp_path / "ckpt"))
    assert message in str(info.value), str(info.value)[-600:]
    # "Load an earlier checkpoint" only where a save may have been cut short.
    assert ("earlier checkpoint" in str(info.value)) == message.endswith("never completed")


@pytest.mark.gpu
@pytest.mark.skipif(not nc.gpu_available(), reason="needs a CUDA GPU with nvCOMP: CUDA shards are compressed on their GPU")
def test_cuda_shards_round_trip(tmp_path: Path) -> None:
    model = _model().cuda()
    state = {"model": model.state_dict()}
    dcp.save(state, storage_writer=NvcompWriter(tmp_path))
    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    dcp.load(fresh, storage_reader=NvcompReader(tmp_path))
    assert_tree_equal(fresh, state)
    with nc.open(next(tmp_path.glob("*.nvcdcp"))) as reader:
        assert all(reader.entry(k).device.startswith("cuda") for k in reader.keys() if k.startswith("model."))


@pytest.mark.gpu
@pytest.mark.skipif(not nc.gpu_available(), reason="needs a CUDA GPU with nvCOMP: device staging clones CUDA shards there")
def test_async_save_staged_on_the_gpu_is_compressed_there_and_point_in_time(tmp_path: Path) -> None:
    model = _model().cuda()
    state = {"model": model.state_dict()}
    saved = {k: v.clone() for k, v in state["model"].items()}
    late = lambda stream: (time.sleep(0.5), stream)[1]  # noqa: E731 - the write starts after the change below
    pending = dcp.async_save(state, storage_writer=NvcompWriter(tmp_path, staging="device", stream_wrapper=late), no_dist=True)
    with torch.no_grad():
        for v in state["model"].values():
            v.add_(1)
    pending.result()
    fresh = {"model": {k: torch.zeros_like(v, device="cpu") for k, v in saved.items()}}
    dcp.load(fresh, storage_reader=NvcompReader(tmp_path), no_dist=True)
    assert_tree_equal(fresh["model"], {k: v.cpu() for k, v in saved.items()})
    with nc.open(next(tmp_path.glob("*.nvcdcp"))) as reader:
        assert all(reader.entry(k).device.startswith("cuda") for k in reader.keys() if k.startswith("model."))


# -- the names and bytes that are part of the format (docs/dcp.md) --------------------------------
def test_metadata_layout_is_pinned(two_rank_run: Path) -> None:
    import pickletools

    from nvcomp_checkpoint.dcp import StoredItem
    from nvcomp_checkpoint.dcp.layout import RECORD_MAGIC, REFUSAL_HEAD
    from nvcomp_checkpoint.dcp.metadata_file import RECORD_MAGIC_JSON

    assert REFUSAL_HEAD == b"\x80\x02cnvcomp_checkpoint.dcp.layout\nrefuse_stock_reader\n"
    assert RECORD_MAGIC == b"NVCDCP\x01\x00" and RECORD_MAGIC_JSON == b"NVCDCP\x02\x00"
    assert f"{StoredItem.__module__}.{StoredItem.__qualname__}" == "nvcomp_checkpoint.dcp.layout.StoredItem"
    data = (two_rank_run / "ours" / ".metadata").read_bytes()
    assert data.startswith(REFUSAL_HEAD)
    stop = next(pos for op, _, pos in pickletools.genops(data) if op.name == "STOP") + 1
    assert data[stop : stop + 8] == RECORD_MAGIC_JSON  # the pickle, then the JSON record (tests/test_dcp_metadata_json.py)
    assert b"nvcomp_checkpoint.dcp.layout" in data[stop:] and b"StoredItem" in data[stop:]
    metadata = NvcompReader(two_rank_run / "ours").read_metadata()
    items = list(metadata.storage_data.values())
    assert all(isinstance(v, StoredItem) for v in items)
    assert {v.key for v in items} >= {"model.0.weight", "optim.state.0.weight.exp_avg", "bytes:extra.note"}


def test_forged_metadata_runs_no_code(tmp_path: Path) -> None:
    import pickle

    from nvcomp_checkpoint.errors import FormatError

    class _Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    model, opt = _plain()
    with pytest.raises(CheckpointException) as info:
        _load_into(model, opt, NvcompReader(tmp_path))
    assert "not a DCP metadata type" in str(info.value)
    assert not (tmp_path / "pwned").exists()
    from nvcomp_checkpoint.dcp import read_stored_metadata

    with pytest.raises(FormatError, match="posix.system|os.system"):
        read_stored_metadata(tmp_path)


def test_fsspec_url_round_trip() -> None:
    model, opt = _plain()
    _train(model, opt, 1, 0)
    url = "memory://nvckpt-dcp-test/ckpt"
    dcp.save(_state(model, opt), checkpoint_id=url, storage_writer=NvcompWriter())
    assert is_compressed_dcp_checkpoint(url)
    fresh, fresh_opt = _plain()
    loaded = _load_into(fresh, fresh_opt, NvcompReader(url))
    assert_tree_equal(_full(fresh, fresh_opt, loaded["extra"]), _full(model, opt, {"step": 7, "note": "sharded"}), "memory://")


def test_plain_dcp_checkpoint_at_a_url_loads() -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    model, opt = _plain()
    _train(model, opt, 1, 0)
    url = "memory://nvckpt-dcp-test/plain"
    dcp.save(_state(model, opt), storage_writer=FsspecWriter(url))
    assert not is_compressed_dcp_checkpoint(url)
    fresh, fresh_opt = _plain()
    loaded = _load_into(fresh, fresh_opt, NvcompReader(url))
    assert_tree_equal(_full(fresh, fresh_opt, loaded["extra"]), _full(model, opt, {"step": 7, "note": "sharded"}), "memory://")


def test_nvckpt_verify_checks_every_rank_file(two_rank_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nvcomp_checkpoint.cli.main import main

    def verify(path: Path) -> tuple[int, str]:
        code = main(["verify", str(path)])
        return code, capsys.readouterr().out

    code, out = verify(two_rank_run / "ours")
    assert code == 0 and "2 files" in out, out
    damaged = tmp_path / "damaged"
    shutil.copytree(two_rank_run / "ours", damaged)
    rank_file = sorted(damaged.glob("__0_*.nvcdcp"))[0]
    with nc.open(rank_file) as reader:
        frame = reader.entry("optim.state.0.weight.exp_avg").frames[-1]
    data = bytearray(rank_file.read_bytes())
    data[frame.offset] ^= 0x01
    rank_file.write_bytes(bytes(data))
    code, out = verify(damaged)
    assert code == 1 and "optim.state.0.weight.exp_avg" in out and rank_file.name in out, out
    # Rank 1's file of a later checkpoint under the expected name (made by the 2-rank run).
    code, out = verify(two_rank_run / "mixed_files")
    assert code == 1 and "not the rank file this checkpoint's metadata names" in out and "__1_" in out, out


def test_plain_directory_compressed_and_back(two_rank_run: Path, tmp_path: Path) -> None:
    from nvcomp_checkpoint.dcp import compress_directory, decompress_directory

    ref = torch.load(two_rank_run / "ref.pt", weights_only=True)
    compress_directory(two_rank_run / "plain", tmp_path / "ours")
    assert is_compressed_dcp_checkpoint(tmp_path / "ours") and len(list((tmp_path / "ours").glob("*.nvcdcp"))) == 2
    decompress_directory(tmp_path / "ours", tmp_path / "plain")
    for name, reader in (("ours", NvcompReader(tmp_path / "ours")), ("plain", dcp.FileSystemReader(tmp_path / "plain"))):
        model, opt = _plain()
        loaded = _load_into(model, opt, reader)
        assert_tree_equal(_full(model, opt, loaded["extra"]), ref, name)
    with pytest.raises(CheckpointError, match="already holds"):
        compress_directory(two_rank_run / "plain", tmp_path / "ours")


def test_zstandard_extension_directory_compressed(tmp_path: Path) -> None:
    from torch.distributed.checkpoint._extension import ZStandard

    from nvcomp_checkpoint.dcp import compress_directory

    model, opt = _plain()
    _train(model, opt, 1, 0)
    dcp.save(_state(model, opt), storage_writer=dcp.FileSystemWriter(tmp_path / "zstd", _extensions=[ZStandard()]))
    compress_directory(tmp_path / "zstd", tmp_path / "ours")
    fresh, fresh_opt = _plain()
    loaded = _load_into(fresh, fresh_opt, NvcompReader(tmp_path / "ours"))
    assert_tree_equal(_full(fresh, fresh_opt, loaded["extra"]), _full(model, opt, {"step": 7, "note": "sharded"}), "zstd->ours")


def test_nvckpt_on_directories_saved_without_collectives(
    two_rank_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nvcomp_checkpoint.cli.main import main

    def nvckpt(*argv: str) -> tuple[int, str]:
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out + out.err

    code, out = nvckpt("inspect", "--json", str(two_rank_run / "nocoll"))
    shown = json.loads(out)
    assert code == 0 and shown["format"] == "dcp-nvcomp" and shown["metadata_files"] == ["__0.metadata", "__1.metadata"]
    assert len(shown["files"]) == 2 and shown["metadata_bytes"] > 0
    code, out = nvckpt("inspect", str(two_rank_run / "nocoll_plain"))
    assert code == 0 and "one per rank" in out, out
    code, out = nvckpt("verify", str(two_rank_run / "nocoll"))
    assert code == 0, out
    # A rank that never committed fails verify, naming its metadata file.
    partial = tmp_path / "partial"
    shutil.copytree(two_rank_run / "nocoll", partial)
    (partial / "__1.metadata").unlink()
    code, out = nvckpt("verify", str(partial))
    assert code == 1 and "__1.metadata: missing" in out, out
    # compress / decompress dispatch to the DCP converters: an ordinary directory comes out.
    code, out = nvckpt("compress", str(two_rank_run / "nocoll_plain"), str(tmp_path / "ours"))
    assert code == 0 and (tmp_path / "ours" / ".metadata").is_file(), out
    ref = torch.load(two_rank_run / "ref.pt", weights_only=True)
    model, opt = _plain()
    loaded = _load_into(model, opt, NvcompReader(tmp_path / "ours"))
    assert_tree_equal(_full(model, opt, loaded["extra"]), ref, "nvckpt compress of a no-collectives directory")


def test_tied_weights_are_stored_once_and_load_under_both_names(tmp_path: Path) -> None:
    # Language models tie the embedding and the output layer: two names, one tensor.
    w = torch.randn(64, 32)
    dcp.save(
        {"m": {"wte.weight": w, "lm_head.weight": w, "b": torch.ones(3)}}, storage_writer=NvcompWriter(tmp_path), no_dist=True
    )
    target = {"m": {"wte.weight": torch.zeros(64, 32), "lm_head.weight": torch.zeros(64, 32), "b": torch.zeros(3)}}
    dcp.load(target, storage_reader=NvcompReader(tmp_path), no_dist=True)
    assert torch.equal(target["m"]["wte.weight"], w) and torch.equal(target["m"]["lm_head.weight"], w)
    assert torch.equal(target["m"]["b"], torch.ones(3))
    rank_file = next(tmp_path.glob("*.nvcdcp"))
    assert rank_file.stat().st_size < 64 * 32 * 4 * 1.5  # the tied tensor's bytes once, not twice


def _process_async_save(rank: int, world: int, tmp: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = {"m": {"w": torch.randn(256, 64, generator=torch.Generator().manual_seed(rank)), "b": torch.arange(10)}}
    for staging in ("host", "device"):
        where = Path(tmp) / staging
        dcp.async_save(
            state, storage_writer=NvcompWriter(where, staging=staging), async_checkpointer_type=AsyncCheckpointerType.PROCESS
        ).result()
        target = {"m": {"w": torch.zeros(256, 64), "b": torch.zeros(10, dtype=torch.long)}}
        dcp.load(target, storage_reader=NvcompReader(where))
        assert_tree_equal(target, state, staging)
    # Stop DCP's background process now (its finalizer asks it to end), not at this rank's os._exit.
    from torch.distributed.checkpoint import _async_process_executor

    _async_process_executor._CHECKPOINT_PROCESS = None


def test_async_save_in_dcps_background_process(tmp_path: Path) -> None:
    # AsyncCheckpointerType.PROCESS: the writer and the staged state cross to DCP's own process.
    _spawn(_process_async_save, 1, str(tmp_path))
    assert is_compressed_dcp_checkpoint(tmp_path / "host") and is_compressed_dcp_checkpoint(tmp_path / "device")
