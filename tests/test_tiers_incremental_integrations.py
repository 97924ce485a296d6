"""``incremental=True`` with ``tiers=`` in the integrations: real Lightning and Accelerate loops on tiny models.

The framework's folder is tier 0 and rotates (ModelCheckpoint's top-k, Accelerate's ``total_limit``);
each delta reaches a tier after the part of its chain the tier lacks, tier retention keeps the bases
that kept deltas need, and after the node is lost a fresh process resumes from a tier (the delta laid
out with its chain): bit-identical state, the same next losses. A chain broken on a tier falls back.
Deferred removals of a folder on an object store are kept there (moto's S3 server).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import fresh_process  # noqa: E402
import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from nvcomp_checkpoint.incremental import DEFERRED_NAME  # noqa: E402
from nvcomp_checkpoint.lightning import NvcompCheckpointIO  # noqa: E402
from nvcomp_checkpoint.tiers import open_tier  # noqa: E402
from test_incremental_integrations import StepLogged, base_name, name, newest_two  # noqa: E402
from test_lightning import BATCHES_PER_EPOCH, fit_tiny  # noqa: E402
from test_tiers_s3 import BUCKET, moto  # noqa: E402,F401 - the moto_server fixture

TESTS_DIR = Path(__file__).resolve().parent
EPOCHS = 5  # a save every epoch (4 steps): 4 full, 8 and 12 deltas, 16 full, 20 a delta of 16


def lightning_tiers(base: Path) -> list[nc.Tier]:
    return [
        nc.Tier(base / "shared", keep=2, name="shared", max_queued=8),
        nc.Tier(base / "archive", every_steps=4, name="archive", max_queued=8),  # every save (4 steps apart)
    ]


def bases(root: Path) -> dict[int, int | None]:
    store = open_tier(str(root))
    return {s: m.base for s, m in store.manifests().items()}


def laid_out(restore: Path, step: int) -> Path:
    """The folder ``resume_path(restore)`` laid the chain of ``step`` out in (one per chain)."""
    found = sorted(p for p in restore.iterdir() if p.name.startswith(f"step-{step:010d}-"))
    assert len(found) == 1 and found[0].is_dir(), found
    return found[0]


RESUME_LIGHTNING = """\
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import test_lightning
from test_incremental_integrations import StepLogged, newest_two
from test_lightning import DumpRestoredState, LossLog, fit_tiny
from test_tiers_incremental_integrations import lightning_tiers
from nvcomp_checkpoint.lightning import NvcompCheckpointIO

test_lightning.TinyModule = StepLogged
plugin = NvcompCheckpointIO(incremental=True, full_every=3, tiers=lightning_tiers(Path({base!r})))
path = plugin.resume_path({restore!r})
print("RESUMED", path)
fit_tiny({root!r}, {epochs}, plugins=[plugin], ckpt_path=path,
         callbacks=[newest_two(Path({ckpts!r})), DumpRestoredState({dump!r}), LossLog({losses!r})])
"""


def _run_script(path: Path, text: str) -> str:
    path.write_text(text)
    proc = fresh_process.run([str(path)], cwd=path.parent, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_lightning_top_k_deltas_reach_the_tiers_and_a_fresh_process_resumes_from_one(tmp_path: Path, monkeypatch) -> None:
    import test_lightning

    monkeypatch.setattr(test_lightning, "TinyModule", StepLogged)
    _, _, straight = fit_tiny(tmp_path / "straight", EPOCHS + 2)  # the run that is never interrupted
    local = tmp_path / "local"
    plugin = NvcompCheckpointIO(incremental=True, full_every=3, tiers=lightning_tiers(tmp_path))
    fit_tiny(tmp_path / "run", EPOCHS, plugins=[plugin], callbacks=[newest_two(local)])
    # ModelCheckpoint keeps the newest two (16 and 20); 4 and 8 waited for 12, and went with it.
    assert sorted(p.name for p in local.iterdir()) == [name(16), name(20)]
    assert base_name(local / name(20)) == name(16)
    # shared keeps 2 steps and the bases they need; archive keeps every step.
    assert bases(tmp_path / "shared") == {16: None, 20: 16}
    assert bases(tmp_path / "archive") == {4: None, 8: 4, 12: 8, 16: None, 20: 16}
    # A copy is the file as ModelCheckpoint wrote it, byte for byte: it still names its base by the framework's name.
    assert (tmp_path / "shared" / "step-0000000020.nvc").read_bytes() == (local / name(20)).read_bytes()
    saved = nc.load(local / name(20), weights_only=False)

    # The node is lost: ModelCheckpoint's folder and the run's. A fresh process resumes from the tiers.
    shutil.rmtree(local)
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    dump, losses = tmp_path / "restored.pt", tmp_path / "losses.json"
    out = _run_script(
        tmp_path / "resume.py",
        RESUME_LIGHTNING.format(
            tests=str(TESTS_DIR),
            base=str(tmp_path),
            restore=str(tmp_path / "restore"),
            root=str(tmp_path / "run2"),
            epochs=EPOCHS + 2,
            ckpts=str(tmp_path / "local2"),
            dump=str(dump),
            losses=str(losses),
        ),
    )
    # Step 20 (a delta) laid out with its base under the name it records.
    chain = laid_out(tmp_path / "restore", 20)
    assert f"RESUMED {chain / 'step-0000000020.nvc'}" in out
    assert sorted(p.name for p in chain.iterdir()) == sorted([name(16), "step-0000000020.nvc"])
    restored = torch.load(dump, weights_only=False)
    assert_tree_equal(saved["state_dict"], restored["state_dict"], "state_dict")
    assert_tree_equal(saved["optimizer_states"][0], restored["optimizer"], "optimizer")
    assert json.loads(losses.read_text()) == straight[EPOCHS * BATCHES_PER_EPOCH :]
    # The resumed run's saves (24 full: the first of a process; 28 a delta of 24) went on to the tiers.
    assert bases(tmp_path / "shared") == {24: None, 28: 24}


def test_lightning_a_chain_broken_on_a_tier_falls_back(tmp_path: Path, monkeypatch, caplog) -> None:
    import test_lightning

    monkeypatch.setattr(test_lightning, "TinyModule", StepLogged)
    local = tmp_path / "local"
    fit_tiny(
        tmp_path / "run",
        EPOCHS,
        plugins=[NvcompCheckpointIO(incremental=True, full_every=3, tiers=lightning_tiers(tmp_path))],
        callbacks=[newest_two(local)],
    )
    states = {s: nc.load(local / name(s), weights_only=False)["state_dict"] for s in (16, 20)}
    shutil.rmtree(local)
    restore = tmp_path / "restore"
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    # The base of step 20 is deleted on shared: 20 comes from archive, laid out with its base.
    (tmp_path / "shared" / "step-0000000016.nvc").unlink()
    fresh = NvcompCheckpointIO(incremental=True, tiers=lightning_tiers(tmp_path))
    path = fresh.resume_path(restore)
    assert path == str(laid_out(restore, 20) / "step-0000000020.nvc")
    assert_tree_equal(states[20], nc.load(path, weights_only=False)["state_dict"])
    # The tier's background cleaning may or may not have removed step 16's orphaned manifest by then:
    # either way step 20 on shared is skipped for its missing base, in one of the two words.
    assert "skipped step 20 on shared" in caplog.text
    assert "base step 16 is not on shared (a broken chain)" in caplog.text or (
        "step-0000000016.nvc: missing (step 16 is listed but its file is gone)" in caplog.text
    )
    # The same base is replaced on archive by another file (the full step 16 file of shared is gone too):
    # no copy of 20 or 16 has its chain; 12 (a delta of depth 2 on archive) is the newest that restores.
    archived_16 = tmp_path / "archive" / "step-0000000016.nvc"
    archived_16.write_bytes((tmp_path / "archive" / "step-0000000012.nvc").read_bytes())
    path = fresh.resume_path(tmp_path / "restore2")
    chain = laid_out(tmp_path / "restore2", 12)
    assert path == str(chain / "step-0000000012.nvc")
    assert sorted(p.name for p in chain.iterdir()) == sorted([name(4), name(8), "step-0000000012.nvc"])
    assert nc.load(path, weights_only=False)["global_step"] == 12
    fresh.teardown()


def test_lightning_deferred_removals_on_s3_outlive_the_process(tmp_path: Path, moto) -> None:  # noqa: F811
    url = f"s3://{BUCKET}/ckpts"

    def state(step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(4096, generator=g) + step * 1e-3
        return {"state_dict": {"w": w}, "global_step": step}

    plugin = NvcompCheckpointIO(incremental=True, full_every=10, fsspec_options=moto.options())
    for step in (1, 2, 3):
        plugin.save_checkpoint(state(step), f"{url}/a-{step}.ckpt")
    with nc.open(f"{url}/a-3.ckpt", storage_options=moto.options()) as r:
        assert r.index.base.path == "a-2.ckpt"
    plugin.remove_checkpoint(f"{url}/a-1.ckpt")
    plugin.remove_checkpoint(f"{url}/a-2.ckpt")
    # a-3 needs both: they stay, listed in a JSON object beside them.
    assert moto.keys("ckpts/") == [f"ckpts/{DEFERRED_NAME}", "ckpts/a-1.ckpt", "ckpts/a-2.ckpt", "ckpts/a-3.ckpt"]
    listed = moto.client().get_object(Bucket=BUCKET, Key=f"ckpts/{DEFERRED_NAME}")["Body"].read()
    assert sorted(json.loads(listed)) == ["a-1.ckpt", "a-2.ckpt"]
    plugin.teardown()
    # The next process removes a-3: the files the first one had to keep go too, and the list.
    later = NvcompCheckpointIO(incremental=True, fsspec_options=moto.options())
    later.remove_checkpoint(f"{url}/a-3.ckpt")
    assert moto.keys("ckpts/") == []


# -- Accelerate ------------------------------------------------------------------------------
RESUME_ACCELERATE = """\
import sys
sys.path.insert(0, {tests!r})
import importlib.util, json, torch
import nvcomp_checkpoint as nc
from nvcomp_checkpoint.accelerate import register_nvcomp_hooks
from test_tiers_incremental_integrations import accelerate_tiers
from test_tiers_s3 import _AWS_ENV
import os
os.environ.update(_AWS_ENV)

spec = importlib.util.spec_from_file_location("acc_train", {script!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
torch.set_num_threads(1)
acc, model, opt, sched, tracker, _ = m.build(project_dir={node!r}, total_limit=2, hooks=False)
hooks = register_nvcomp_hooks(acc, incremental=True, full_every=3, tiers=accelerate_tiers({base!r}, {endpoint!r}))
objs = (acc, model, opt, sched, tracker, hooks)
path = hooks.resume_path({restore!r})
print("RESUMED", path)
acc.load_state(path)
torch.save(m.snapshot(objs), {dump!r})
with open({losses!r}, "w") as f:
    json.dump(m.train(objs, 3), f)
acc.save_state()
hooks.remove()
"""


def accelerate_tiers(base: str | Path, endpoint: str) -> list[nc.Tier]:
    options = {"client_kwargs": {"endpoint_url": endpoint}, "key": "x", "secret": "y", "skip_instance_cache": True}
    return [
        nc.Tier(Path(base) / "shared", keep=2, name="shared", max_queued=8),
        nc.Tier(f"s3://{BUCKET}/run1", every_steps=2, keep=1, name="object", storage_options=options, max_queued=8),
    ]


def test_accelerate_total_limit_deltas_reach_s3_and_a_fresh_process_resumes_from_s3(tmp_path: Path, moto) -> None:  # noqa: F811
    pytest.importorskip("accelerate")
    from nvcomp_checkpoint.accelerate import register_nvcomp_hooks
    from test_accelerate import SCRIPT, _module

    script = tmp_path / "acc_train.py"
    script.write_text(SCRIPT)
    m = _module(script)
    torch.set_num_threads(1)
    node = tmp_path / "node1"
    acc, model, opt, sched, tracker, _ = m.build(project_dir=str(node), total_limit=2, hooks=False)
    hooks = register_nvcomp_hooks(acc, incremental=True, full_every=3, tiers=accelerate_tiers(tmp_path, moto.endpoint))
    objs = (acc, model, opt, sched, tracker, hooks)
    for _ in range(5):  # save_state 0 full, 1 and 2 deltas, 3 full, 4 a delta of 3
        m.train(objs, 1)
        acc.save_state()
    hooks.wait()
    at_save = m.snapshot(objs)
    straight = m.train(objs, 3)
    hooks.remove()
    assert sorted(p.name for p in (node / "checkpoints").iterdir()) == ["checkpoint_3", "checkpoint_4"]
    assert bases(tmp_path / "shared") == {3: None, 4: 3}
    # The object tier copies every 2nd save (0, 2, 4): 2 brought 1, 4 brought 3; keep=1 kept 4's chain.
    assert {k.split("/")[1] for k in moto.keys("run1/")} == {
        f"step-000000000{s}{x}" for s in (3, 4) for x in ("", ".manifest.json")
    }
    assert moto.uploads() == []

    # The node is lost, and the shared tier with it: a fresh process resumes from S3 only.
    shutil.rmtree(node)
    shutil.rmtree(tmp_path / "shared")
    restore, dump, losses = tmp_path / "node2" / "restore", tmp_path / "restored.pt", tmp_path / "losses.json"
    out = _run_script(
        tmp_path / "resume.py",
        RESUME_ACCELERATE.format(
            tests=str(TESTS_DIR),
            script=str(script),
            node=str(tmp_path / "node2"),
            base=str(tmp_path),
            endpoint=moto.endpoint,
            restore=str(restore),
            dump=str(dump),
            losses=str(losses),
        ),
    )
    # Step 4 laid out with its base where model.nvc names it (../checkpoint_3/model.nvc).
    chain = laid_out(restore, 4)
    assert f"RESUMED {chain / 'step-0000000004'}" in out
    assert sorted(p.name for p in chain.iterdir()) == ["checkpoint_3", "step-0000000004"]
    assert_tree_equal(torch.load(dump, weights_only=False), at_save)
    assert json.loads(losses.read_text()) == straight
    # Its next save (iteration 5, the first of the process: full) went on to the tiers.
    assert bases(tmp_path / "shared") == {5: None}
