"""The integrations' ``tiers=`` with an object-store tier on a real S3 endpoint (moto's server, s3fs over HTTP).

A ``save_state`` folder is a directory unit: copied file by file to S3, and on a fresh node
downloaded (checked) before ``load_state``, which reads local folders only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import nvcomp_checkpoint as nc  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402
from nvcomp_checkpoint.accelerate import register_nvcomp_hooks  # noqa: E402
from test_accelerate import _module, script  # noqa: E402,F401 - script is a fixture
from test_tiers_s3 import BUCKET, moto  # noqa: E402,F401 - moto is a fixture


def test_accelerate_copies_to_s3_and_a_fresh_node_resumes_from_s3_only(script, moto, tmp_path: Path) -> None:  # noqa: F811
    m = _module(script)
    torch.set_num_threads(1)

    def build(node: Path):
        acc, model, opt, sched, tracker, _ = m.build(
            project_dir=str(node), total_limit=3, hooks=False
        )  # room for the uploads to finish
        tier = nc.Tier(f"s3://{BUCKET}/run1", keep=2, name="object", storage_options=moto.options(), max_queued=8)
        return acc, model, opt, sched, tracker, register_nvcomp_hooks(acc, tiers=[tier])

    objs = build(tmp_path / "node1")
    for _ in range(3):
        m.train(objs, 1)
        objs[0].save_state()
    objs[5].wait()
    at_save = m.snapshot(objs)
    straight = m.train(objs, 2)
    objs[5].remove()
    keys = moto.keys("run1/")
    assert {k.split("/")[1] for k in keys} == {
        "step-0000000001",
        "step-0000000001.manifest.json",
        "step-0000000002",
        "step-0000000002.manifest.json",
    }, keys  # keep=2
    assert moto.uploads() == []

    shutil.rmtree(tmp_path / "node1")  # the node is lost: only S3 is left
    objs2 = build(tmp_path / "node2")
    path = objs2[5].resume_path(tmp_path / "node2" / "restored")
    assert Path(path).name == "step-0000000002" and Path(path).parent.parent == tmp_path / "node2" / "restored"
    objs2[0].load_state(path)
    assert_tree_equal(m.snapshot(objs2), at_save)
    assert m.train(objs2, 2) == straight
    objs2[5].remove()
