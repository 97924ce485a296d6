"""An S3 tier that stops answering or does not exist: restore, retention and close on a real endpoint.

moto's standalone server runs in its own process (one for the module); SIGSTOP freezes it the way an
unresponsive endpoint behaves (connections are accepted, nothing is answered), SIGCONT resumes it.
Short client timeouts (1 s) and short restore/close deadlines keep every case to seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.errors import CopyTimeoutError, TierNotFoundError, TierUnavailableError
from nvcomp_checkpoint.tiers import TierCopies, open_tier, verify_unit

pytest.importorskip("boto3")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from test_tiers_s3 import BUCKET, MotoServer, served  # noqa: E402 - after the skips


class FrozenMoto(MotoServer):
    connect_timeout, read_timeout = 1, 1  # a frozen server is given up on in seconds

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """The server process stopped (SIGSTOP): it accepts connections and answers nothing."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrozenMoto]:
    with served(FrozenMoto(tmp_path_factory.mktemp("moto") / "moto_server.log")) as server:
        yield server


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(64, 32), "b": torch.randn(64)}, "optimizer": {"m": torch.randn(64, 32)}, "step": step}


def _manifests(moto: FrozenMoto, prefix: str) -> list[str]:
    return [k.rsplit("/", 1)[-1] for k in moto.keys(prefix + "/") if k.endswith(".manifest.json")]


def _s3_tier(moto: FrozenMoto, prefix: str, **kw: Any) -> nc.Tier:
    return nc.Tier(f"s3://{BUCKET}/{prefix}", name="object", storage_options=moto.options(), retries=0, **kw)


def test_restore_during_an_outage_raises_and_the_next_save_keeps_every_step(moto, tmp_path, caplog):
    s3 = _s3_tier(moto, "outage", keep=2)
    with nc.CheckpointManager([nc.Tier(tmp_path / "node1", keep=2), s3]) as mgr:
        for step in (100, 200):
            mgr.save(step, _state(step))
            mgr.wait()
    assert _manifests(moto, "outage") == ["step-0000000100.manifest.json", "step-0000000200.manifest.json"]

    # A fresh node (empty tier 0) while the endpoint answers nothing: never "no checkpoint".
    mgr = nc.CheckpointManager([nc.Tier(tmp_path / "node2", keep=2), s3])
    with moto.frozen():
        started = time.monotonic()
        with pytest.raises(TierUnavailableError, match=r"object \(s3://tiers/outage\)") as err:
            mgr.restore(timeout=3)
        assert time.monotonic() - started < 8  # the deadline, not the client's retries (15 s and more)
    assert isinstance(err.value, OSError)
    # A run that starts fresh anyway (it caught the error): its saves never remove what it did not see.
    caplog.set_level(logging.WARNING, logger="nvcomp_checkpoint")
    mgr.save(1, _state(1))
    mgr.close()
    assert _manifests(moto, "outage") == [
        "step-0000000001.manifest.json",
        "step-0000000100.manifest.json",
        "step-0000000200.manifest.json",
    ]
    assert "newer than step 1" in caplog.text and "kept" in caplog.text
    # Once the endpoint answers, a restore finds step 200, as saved.
    r = nc.CheckpointManager([nc.Tier(tmp_path / "node3"), s3]).restore()
    assert (r.step, r.tier_name) == (200, "object")
    assert_tree_equal(_state(200), r.state)


def test_restore_with_tier0_newest_does_not_need_the_frozen_tier(moto, tmp_path):
    """Tier 0 takes every save: its newest step is the run's newest, whatever a slower tier holds."""
    s3 = _s3_tier(moto, "tier0-newest", keep=2)
    tiers = [nc.Tier(tmp_path / "local", keep=2), s3]
    with nc.CheckpointManager(tiers) as mgr:
        for step in (10, 20):
            mgr.save(step, _state(step))
            mgr.wait()
    mgr = nc.CheckpointManager(tiers)
    with moto.frozen():
        r = mgr.restore(timeout=2)
        assert (r.step, r.tier) == (20, 0)
        assert [(s, t) for s, t, _ in r.skipped] == [(-1, "object")]
        # Step 20 damaged on tier 0: step 10 is no answer while the frozen tier may hold a good 20.
        f = tmp_path / "local" / "step-0000000020.nvc"
        data = bytearray(f.read_bytes())
        data[len(data) // 3] ^= 0xFF
        f.write_bytes(bytes(data))
        with pytest.raises(TierUnavailableError, match="object"):
            mgr.restore(timeout=2)
    r = mgr.restore()
    assert (r.step, r.tier_name) == (20, "object")


def test_a_missing_bucket_is_an_error_an_empty_prefix_a_fresh_start(moto, tmp_path):
    missing = nc.Tier("s3://no-such-bucket/run1", name="object", storage_options=moto.options())
    mgr = nc.CheckpointManager([nc.Tier(tmp_path / "a"), missing])
    with pytest.raises(TierNotFoundError, match="no-such-bucket") as err:
        mgr.restore()
    assert isinstance(err.value, FileNotFoundError)
    empty = _s3_tier(moto, "never-written")
    assert nc.CheckpointManager([nc.Tier(tmp_path / "b"), empty]).restore() is None


def test_close_gives_up_on_a_frozen_tier_by_its_deadline_and_names_what_is_not_copied(moto, tmp_path):
    s3 = _s3_tier(moto, "close-deadline")
    mgr = nc.CheckpointManager([nc.Tier(tmp_path / "local"), s3])
    mgr.save(1, _state(1))
    mgr.wait()
    with moto.frozen():
        mgr.save(2, _state(2)).result()
        started = time.monotonic()
        with pytest.raises(CopyTimeoutError) as err:
            mgr.close(timeout=2)
        assert time.monotonic() - started < 6
    pending = err.value.pending
    assert [(p.step, p.tier) for p in pending] == [(2, "object")]
    assert pending[0].path == str(tmp_path / "local" / "step-0000000002.nvc") and Path(pending[0].path).is_file()
    assert "step 2" in str(err.value) and str(tmp_path / "local") in str(err.value)
    # Whatever the abandoned copy did once the endpoint answered again, every listed step checks.
    store = open_tier(f"s3://{BUCKET}/close-deadline", moto.options())
    for m in store.manifests().values():
        assert verify_unit(store, m) is None
    assert 1 in store.manifests()


def test_a_manager_made_during_an_outage_holds_no_caller_past_its_deadline(moto, tmp_path):
    """The constructor does no I/O on the tiers (leftovers are cleaned in the background, each tier before
    its first write), so restore(timeout=2) and TierCopies.resume_path(timeout=2) return by their deadline
    (the constructor cleaned and listed every tier first, through the client's retries: 34 s with this test's 1 s client timeouts, minutes with the defaults)."""
    s3 = _s3_tier(moto, "made-during-outage", keep=2)
    with nc.CheckpointManager([nc.Tier(tmp_path / "node1", keep=2), s3]) as mgr:
        mgr.save(1, _state(1))
    with moto.frozen():
        started = time.monotonic()
        mgr = nc.CheckpointManager([nc.Tier(tmp_path / "node2", keep=2), s3])
        with pytest.raises(TierUnavailableError, match="made-during-outage"):
            mgr.restore(timeout=2)
        assert time.monotonic() - started < 20  # the deadline and a margin for a loaded machine (it took 34 s)
        started = time.monotonic()
        copies = TierCopies([s3], "X(tiers=...)")
        with pytest.raises(TierUnavailableError, match="made-during-outage"):
            copies.resume_path(tmp_path / "fetched", timeout=2)
        assert time.monotonic() - started < 20  # the deadline and a margin for a loaded machine (it took 34 s)
    # Once the endpoint answers: the same manager restores, saves and copies (after its cleaning).
    assert mgr.restore().step == 1
    mgr.save(2, _state(2))
    mgr.close()
    assert _manifests(moto, "made-during-outage") == ["step-0000000001.manifest.json", "step-0000000002.manifest.json"]
