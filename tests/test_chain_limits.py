"""Chains of delta checkpoints are bounded: at most ``MAX_CHAIN_DEPTH`` deep, never a loop, short errors.

A chain exactly ``MAX_CHAIN_DEPTH`` deep written with ``nc.save(base=...)`` loads; one more delta
is refused by the explicit save (a chain policy writes a full checkpoint instead, with a
warning). A deeper chain (written by a version without the limit: here by lifting it) is refused
when read with a short error, never a RecursionError. Base records that point back at a file of
their own chain (forged) are named as a loop, and no walk of a chain runs forever.
"""

from __future__ import annotations

import json
import logging
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
import nvcomp_checkpoint.delta as delta_module
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.delta import ChainPolicy, chain_of
from nvcomp_checkpoint.errors import BaseCheckpointError, CheckpointError
from nvcomp_checkpoint.format.chain import MAX_CHAIN_DEPTH
from nvcomp_checkpoint.format.layout import FOOTER, pack_footer
from nvcomp_checkpoint.incremental import IncrementalFiles, keep_with_bases

#: Every error about a chain is short, however deep the chain (one was 27 KB).
SHORT = 500
DEEP = 200


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail (TimeoutError) instead of hanging when a walk of a chain does not end."""

    def expire(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _state(step: int) -> dict:
    """Tiny, and XORs to mostly zeros against the previous step's, so every link is a real delta."""
    w = torch.randn(2048, generator=torch.Generator().manual_seed(0))
    w[: step % 2048] += 1.0
    return {"model": {"w": w}, "step": step}


@pytest.fixture(scope="module")
def deep_chain(tmp_path_factory) -> list[Path]:
    """``c0`` (full) <- ``c1`` <- ... <- ``c200``, written by the API with the depth limit lifted
    (as a version without it wrote them)."""
    directory = tmp_path_factory.mktemp("deep")
    paths: list[Path] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(delta_module, "MAX_CHAIN_DEPTH", 10_000)
        for step in range(DEEP + 1):
            path = directory / f"c{step}.nvc"
            # base_state: the writer takes the base's values from it, not by decoding the chain
            # (which, this deep, exhausts the stack: the reason for the limit).
            nc.save(_state(step), path, base=paths[-1] if paths else None, base_state=_state(step - 1) if paths else None)
            paths.append(path)
    with nc.open(paths[-1]) as reader:
        assert reader.index.base.depth == DEEP and [t.delta is not None for t in reader.index.tensors] == [True]
    return paths


def test_a_chain_exactly_at_the_limit_loads(deep_chain):
    at_limit = deep_chain[MAX_CHAIN_DEPTH]
    loaded = nc.load(at_limit)
    assert torch.equal(loaded["model"]["w"], _state(MAX_CHAIN_DEPTH)["model"]["w"]) and loaded["step"] == MAX_CHAIN_DEPTH
    assert nc.verify(at_limit).ok
    assert len(chain_of(str(at_limit), nc.open)) == MAX_CHAIN_DEPTH + 1


@pytest.mark.parametrize("depth", [MAX_CHAIN_DEPTH + 1, DEEP])
def test_a_deeper_chain_is_refused_with_a_short_error(deep_chain, depth):
    path = deep_chain[depth]
    for run in (lambda: nc.load(path), lambda: nc.open(path).read("model/w")):
        with pytest.raises(BaseCheckpointError) as info:
            run()
        text = str(info.value)
        assert f"{depth} deep" in text and f"limit of {MAX_CHAIN_DEPTH}" in text and str(path) in text, text
        assert len(text) < SHORT, len(text)
    with nc.open(path) as reader:  # the index and the tensors that need no base still read
        assert reader.keys() == ["model/w"] and reader.index.base.depth == depth
    result = nc.verify(path)
    assert not result.ok and all(len(str(p.error)) < SHORT for p in result.problems)
    with pytest.raises(BaseCheckpointError, match="deep"):
        chain_of(str(path), nc.open)


def test_cli_verify_of_a_too_deep_chain_fails_briefly(deep_chain, capsys):
    assert main(["verify", str(deep_chain[DEEP])]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and f"limit of {MAX_CHAIN_DEPTH}" in out, out[-2000:]
    assert max(len(line) for line in out.splitlines()) < SHORT + 200


def test_an_explicit_save_past_the_limit_is_refused(deep_chain, tmp_path):
    target = tmp_path / "next.nvc"
    with pytest.raises(BaseCheckpointError) as info:
        nc.save(_state(1), target, base=deep_chain[MAX_CHAIN_DEPTH])
    text = str(info.value)
    assert f"limit of {MAX_CHAIN_DEPTH}" in text and "without base=" in text and "nvckpt rebase" in text, text
    assert len(text) < SHORT and not target.exists()
    nc.save(_state(1), target, base=deep_chain[MAX_CHAIN_DEPTH - 1])  # one less: depth MAX_CHAIN_DEPTH
    with nc.open(target) as reader:
        assert reader.index.base.depth == MAX_CHAIN_DEPTH


def test_a_missing_base_deep_in_a_chain_gives_a_short_error(tmp_path):
    paths = []
    for step in range(40):
        path = tmp_path / f"c{step}.nvc"
        nc.save(_state(step), path, base=paths[-1] if paths else None)
        paths.append(path)
    paths[0].unlink()
    with pytest.raises(BaseCheckpointError) as info:
        nc.load(paths[-1])
    text = str(info.value)
    assert len(text) < SHORT and str(paths[-1]) in text, (len(text), text[:1000])
    assert "c0.nvc" in text  # the file that is missing is named, however deep


def test_chain_policies_never_build_a_chain_past_the_limit(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="nvcomp_checkpoint"):
        policy = ChainPolicy(full_every=DEEP, base="previous")
    assert f"every {MAX_CHAIN_DEPTH + 1} saves" in caplog.text
    saved: list[str] = []
    full = []
    for n in range(2 * (MAX_CHAIN_DEPTH + 1) + 3):
        base = policy.base_for(saved)
        if base is None:
            full.append(n)
        saved.append(f"s{n}")
    assert full == [0, MAX_CHAIN_DEPTH + 1, 2 * (MAX_CHAIN_DEPTH + 1)]
    assert ChainPolicy(full_every=DEEP, base="full").base_for([f"s{n}" for n in range(150)]) == "s0"  # depth 1 always
    assert (
        ChainPolicy(full_every=MAX_CHAIN_DEPTH + 1).base_for([f"s{n}" for n in range(MAX_CHAIN_DEPTH)])
        == f"s{MAX_CHAIN_DEPTH - 1}"
    )
    # The integrations' bookkeeping uses the same policy: the save after a chain at the limit is full.
    files = IncrementalFiles("test", nc.ChainPolicy(DEEP))
    bases = [files.base_for(tmp_path / f"f{n}.nvc") for n in range(MAX_CHAIN_DEPTH + 2)]
    assert bases[0] is None and bases[MAX_CHAIN_DEPTH + 1] is None and None not in bases[1 : MAX_CHAIN_DEPTH + 1]


# -- forged loops ---------------------------------------------------------------------------------


def _set_base(path: Path, base: dict) -> None:
    """Rewrite ``path``'s base record (index and footer digests recomputed: a forgery that checks out)."""
    data = path.read_bytes()
    offset, size, _, _ = FOOTER.unpack(data[-FOOTER.size :])
    index = json.loads(data[offset : offset + size])
    index["base"] = base
    raw = json.dumps(index).encode()
    path.write_bytes(data[:offset] + raw + pack_footer(offset, len(raw), xxhash.xxh3_64_intdigest(raw)))


def _record(path: Path, depth: int) -> dict:
    with nc.open(path) as reader:
        return {"path": path.name, "size": reader.file_bytes, "index_xxh3": f"{reader.index_xxh3:016x}", "depth": depth}


@pytest.fixture
def loop(tmp_path) -> dict[str, Path]:
    """``a`` <-> ``b`` (each one's base is the other) and ``self`` (its own base); deltas of a real full file."""
    full = tmp_path / "full.nvc"
    nc.save(_state(0), full)
    paths = {name: tmp_path / f"{name}.nvc" for name in ("a", "b", "self")}
    for i, path in enumerate(paths.values()):
        nc.save(_state(i + 1), path, base=full)
    _set_base(paths["a"], _record(paths["b"], 2))
    _set_base(paths["b"], _record(paths["a"], 2))
    _set_base(paths["self"], _record(paths["self"], 2))
    return paths


@pytest.mark.parametrize("name", ["a", "b", "self"])
def test_a_save_against_a_looping_chain_ends_and_names_the_loop(loop, tmp_path, name):
    target = tmp_path / "new.nvc"
    with _deadline(30):
        with pytest.raises(BaseCheckpointError) as info:
            nc.save(_state(9), target, base=loop[name])
    text = str(info.value)
    assert "loops back to" in text and len(text) < SHORT, text
    assert not target.exists()


@pytest.mark.parametrize("name", ["a", "b", "self"])
def test_reading_a_looping_chain_ends_with_a_short_error(loop, name, capsys):
    path = loop[name]
    with _deadline(30):
        for run in (lambda: nc.load(path), lambda: chain_of(str(path), nc.open)):
            with pytest.raises(BaseCheckpointError) as info:
                run()
            assert len(str(info.value)) < SHORT, str(info.value)
        assert not nc.verify(path).ok
        assert main(["verify", str(path)]) == 1
        assert main(["inspect", str(path)]) in (0, 1)
    out = capsys.readouterr().out
    assert "FAILED" in out


def test_chain_walks_of_the_integrations_end_on_a_loop(loop):
    with _deadline(30):
        kept = keep_with_bases([str(loop["a"])])
    assert kept == {str(loop["a"]), str(loop["b"])}


def test_every_chain_error_is_a_checkpoint_error(loop):
    with pytest.raises(CheckpointError):
        nc.load(loop["self"])
