"""Paths read from a file or a store (a tier manifest's entries, a delta's base record, DeepSpeed's
``latest``) never make us read, write or request anything outside that checkpoint's folder, prefix or store."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
from forged_files import with_base_path
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.errors import CheckpointError, UnsafePathError
from nvcomp_checkpoint.safepaths import inside_path

STEP = 100
UNIT = f"step-{STEP:010d}"


# -- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        "../x",
        "a/../../x",
        "a/..",
        "/etc/passwd",
        "http://169.254.169.254/latest",
        "s3://other-bucket/x",
        "simplecache::s3://b/x",
        "C:x",
        "a\\..\\x",
        "a\x00b",
        "",
        ".",
        "a//b",
        "a/./b",
        "a/",
        "x" * 256,
        7,
        None,
        ["a"],
    ],
)
def test_the_rule_refuses_each_way_out(entry: Any) -> None:
    with pytest.raises(UnsafePathError, match=r"manifest\.json: names the file .*not a path inside its checkpoint"):
        inside_path(entry, where="/t/manifest.json", what="names the file")


@pytest.mark.parametrize("entry", ["model.nvc", "sub/dir/file.bin", "epoch=0-step=4.ckpt", "a..b", "..a", "x" * 255])
def test_the_rule_keeps_plain_paths(entry: str) -> None:
    assert inside_path(entry, where="w", what="names") == entry


def test_a_plain_name_has_no_folders_and_a_base_may_go_up_but_not_out() -> None:
    with pytest.raises(UnsafePathError, match="not a plain name"):
        inside_path("a/b", where="w", what="names", single=True)
    assert inside_path("../checkpoint-3/model.nvc", where="w", what="records", up=True) == "../checkpoint-3/model.nvc"
    for entry in ("/abs/base.nvc", "http://h/base.nvc", "..", "../a/./b"):
        with pytest.raises(UnsafePathError):
            inside_path(entry, where="w", what="records", up=True)


# -- tier manifests ----------------------------------------------------------------------------


def _forge_unit(tier: Path, entry: str, target: Path, data: bytes = b"planted bytes\n") -> None:
    """A directory unit of step 100 on ``tier`` whose manifest names ``entry``; ``target``, where the
    entry leads from the unit's folder, holds the bytes the manifest describes (as an attacker would)."""
    unit = tier / UNIT
    unit.mkdir(parents=True)
    (unit / "ok.bin").write_bytes(b"ok")
    assert os.path.normpath(unit / entry) == os.path.normpath(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    _write_manifest(tier / f"{UNIT}.manifest.json", entry, data)


def _manifest(entry: str, data: bytes) -> bytes:
    doc = {
        "format": "nvckpt-unit",
        "version": 1,
        "step": STEP,
        "unit": UNIT,
        "directory": True,
        "light": False,
        "created": time.time(),
        "files": [{"path": entry, "size": len(data), "index_xxh3": None, "xxh3": xxhash.xxh3_64_intdigest(data)}],
    }
    return json.dumps(doc).encode()


def _write_manifest(path: Path, entry: str, data: bytes) -> None:
    path.write_bytes(_manifest(entry, data))


def test_ls_does_not_read_outside_the_tier_nor_call_the_step_verified(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "runs" / "src"
    _forge_unit(src, "../../secret", tmp_path / "runs" / "secret")
    assert main(["ls", "--json", str(src)]) == 1
    (row,) = json.loads(capsys.readouterr().out)["tiers"][str(src)]
    assert row["step"] == STEP and row["verifies"] is False
    assert "'../../secret'" in row["problem"] and f"{UNIT}.manifest.json" in row["problem"], row["problem"]


def test_a_single_file_unit_names_no_path_of_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A single-file unit's one entry has the path ``""``; a forged one would be joined below the unit's name."""
    src = tmp_path / "runs" / "src"
    (src / f"{UNIT}.nvc").mkdir(parents=True)  # a folder under the file's name, so that the join resolves
    data = b"planted bytes\n"
    (tmp_path / "runs" / "secret").write_bytes(data)
    doc = json.loads(_manifest("../../secret", data))
    doc.update(directory=False, unit=f"{UNIT}.nvc")
    (src / f"{UNIT}.manifest.json").write_text(json.dumps(doc))
    assert main(["ls", "--json", str(src)]) == 1
    (row,) = json.loads(capsys.readouterr().out)["tiers"][str(src)]
    assert row["verifies"] is False and "'../../secret' in the single-file unit" in row["problem"], row["problem"]


def _sync_names(entry: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    """``nvckpt sync`` said why the step is not copied (a warning, or its own output), naming the entry."""
    out = capsys.readouterr()
    said = " ".join([*(r.getMessage() for r in caplog.records), out.out, out.err])
    assert f"{entry!r}" in said and "not a path inside" in said, said


def test_sync_does_not_write_outside_the_destination(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = tmp_path / "s" / "src", tmp_path / "d" / "x" / "dst"
    _forge_unit(src, "../../planted", tmp_path / "s" / "planted")
    main(["sync", "--json", str(src), str(dst)])  # its exit code for a step it cannot list is sync's own policy
    assert not (tmp_path / "d" / "x" / "planted").exists()
    assert not (dst / f"{UNIT}.manifest.json").exists()
    _sync_names("../../planted", caplog, capsys)


def test_fetch_does_not_write_outside_its_local_folder(tmp_path: Path) -> None:
    src, local = tmp_path / "f" / "src", tmp_path / "l" / "local"
    # From local/.step-...tmp-*/step-0000000100/, three folders up is the local folder's parent.
    _forge_unit(src, "../../../planted", tmp_path / "planted")
    with pytest.raises(UnsafePathError, match=r"'\.\./\.\./\.\./planted'"):
        nc.CheckpointManager([nc.Tier(src)]).fetch(STEP, 0, local)
    assert not (tmp_path / "l" / "planted").exists()


def test_restore_skips_a_unit_whose_manifest_leaves_the_tier(tmp_path: Path) -> None:
    tier = tmp_path / "t"
    with nc.CheckpointManager([nc.Tier(tier)]) as mgr:
        mgr.save(50, {"w": torch.ones(4)})
    _forge_unit(tier, "../../planted", tmp_path / "planted")
    restored = nc.CheckpointManager([nc.Tier(tier)]).restore()
    assert restored.step == 50


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[Any]:
    from test_tiers_s3 import MotoServer, served  # the moto_server child process of the S3 tier tests

    with served(MotoServer(tmp_path / "moto_server.log")) as server:
        yield server


def _put(server: Any, key: str, data: bytes) -> None:
    server.client().put_object(Bucket="tiers", Key=key, Body=data)


def test_a_hostile_bucket_cannot_make_sync_write_or_ls_read_outside(
    s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    data = b"planted in the bucket\n"
    _put(s3, f"run/{UNIT}/ok.bin", b"ok")
    _put(s3, f"run/{UNIT}.manifest.json", _manifest("../../../planted", data))
    # Wherever the client resolves the entry (the literal key, or with the dots removed), the bytes are there.
    _put(s3, f"run/{UNIT}/../../../planted", data)
    _put(s3, "planted", data)
    url, dst = "s3://tiers/run", tmp_path / "a" / "b" / "dst"
    endpoint = ["--endpoint-url", s3.endpoint]
    assert main(["ls", "--json", *endpoint, url]) == 1
    (row,) = json.loads(capsys.readouterr().out)["tiers"][url]
    assert row["verifies"] is False and "'../../../planted'" in row["problem"]
    main(["sync", "--json", *endpoint, url, str(dst)])
    assert not (tmp_path / "planted").exists() and not (tmp_path / "a" / "planted").exists()
    assert not (dst / f"{UNIT}.manifest.json").exists()
    _sync_names("../../../planted", caplog, capsys)


# -- a delta's base record ---------------------------------------------------------------------


class _Counting(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []
    body = b""

    def _answer(self, with_body: bool) -> None:
        type(self).requests.append(f"{self.command} {self.path}")
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        if with_body:
            self.wfile.write(self.body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(False)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _server(body: bytes) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on 127.0.0.1 serving ``body`` at every path; yields its URL and the requests it saw."""
    handler = type("Handler", (_Counting,), {"requests": [], "body": body})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler.requests
    finally:
        httpd.shutdown()
        httpd.server_close()


def _delta(tmp_path: Path) -> tuple[Path, Path]:
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    base, delta = tmp_path / "base.nvc", tmp_path / "delta.nvc"
    nc.save({"model": {"w": w}}, base)
    w2 = w.clone()
    w2[0] += 1
    nc.save({"model": {"w": w2}}, delta, base=base)
    return base, delta


@pytest.fixture
def forged_url(tmp_path: Path) -> Iterator[tuple[Path, str, list[str]]]:
    """A local delta whose base record is an http:// URL of a server that serves the real base."""
    base, delta = _delta(tmp_path)
    with _server(base.read_bytes()) as (url, requests):
        forged = tmp_path / "forged.nvc"
        stored = f"{url}/latest/meta-data/base.nvc"
        forged.write_bytes(with_base_path(delta.read_bytes(), stored))
        yield forged, stored, requests


def _names(exc_text: str, forged: Path, stored: str) -> None:
    assert str(forged) in exc_text and stored in exc_text and "not a path inside" in exc_text, exc_text


def test_load_sends_no_request_to_a_base_url(forged_url: tuple[Path, str, list[str]]) -> None:
    forged, stored, requests = forged_url
    with pytest.raises(UnsafePathError) as info:
        nc.load(forged)
    _names(str(info.value), forged, stored)
    assert requests == []


def test_open_read_sends_no_request_to_a_base_url(forged_url: tuple[Path, str, list[str]]) -> None:
    forged, stored, requests = forged_url
    with nc.open(forged) as reader:
        assert reader.keys() == ["model/w"]  # the index is the delta's own: it opens
        with pytest.raises(CheckpointError) as info:
            reader.read("model/w")
    _names(str(info.value), forged, stored)
    assert requests == []


def test_verify_sends_no_request_to_a_base_url(forged_url: tuple[Path, str, list[str]]) -> None:
    forged, stored, requests = forged_url
    result = nc.verify(forged)
    assert not result.ok
    _names(" ".join(str(p) for p in result.problems), forged, stored)
    assert requests == []


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_the_cli_sends_no_request_to_a_base_url(
    forged_url: tuple[Path, str, list[str]], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    forged, stored, requests = forged_url
    code = main([command, "--json", str(forged)])
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    if command == "verify":
        assert code != 0
    _names(text, forged, stored)
    assert requests == []


def test_a_base_at_an_absolute_path_is_refused(tmp_path: Path) -> None:
    base, delta = _delta(tmp_path)
    forged = tmp_path / "elsewhere" / "forged.nvc"
    forged.parent.mkdir()
    forged.write_bytes(with_base_path(delta.read_bytes(), str(base.resolve())))
    with pytest.raises(UnsafePathError, match="an absolute path"):
        nc.load(forged)


def test_a_base_in_a_sibling_folder_still_loads(tmp_path: Path) -> None:
    (tmp_path / "c3").mkdir()
    (tmp_path / "c4").mkdir()
    w = torch.arange(4096, dtype=torch.float32)
    nc.save({"model": {"w": w}}, tmp_path / "c3" / "model.nvc")
    nc.save({"model": {"w": w + 1}}, tmp_path / "c4" / "model.nvc", base=tmp_path / "c3" / "model.nvc")
    with nc.open(tmp_path / "c4" / "model.nvc") as reader:
        assert reader.index.base is not None and reader.index.base.path == "../c3/model.nvc"
    assert torch.equal(nc.load(tmp_path / "c4" / "model.nvc")["model"]["w"], w + 1)


def test_save_refuses_a_base_on_another_store(tmp_path: Path) -> None:
    base, _ = _delta(tmp_path)
    with pytest.raises(CheckpointError, match="another store"):
        nc.save({"model": {"w": torch.ones(4)}}, "memory://bucket/delta.nvc", base=base)


# -- DeepSpeed's `latest` ----------------------------------------------------------------------


def test_an_attached_engine_loads_no_tag_that_latest_names_outside_the_folder(tmp_path: Path) -> None:
    """A real DeepSpeed engine (one rank, ZeRO 0, gloo on the CPU) after ``attach``, as the CLI refuses the same pointer."""
    import importlib.util

    import fresh_process

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    script = Path(__file__).with_name("deepspeed_train.py")
    env = {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(script.parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = fresh_process.run_ranks(
        (str(script), "latest_outside", "0", str(tmp_path)),
        1,
        cwd=os.getcwd(),
        env=dict(os.environ, PYTHONWARNINGS="ignore", **env),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    outcome = json.loads((tmp_path / "latest_outside.json").read_text())
    latest = str(tmp_path / "run" / "latest")
    assert outcome["dotdot"].startswith("UnsafePathError") and "'../other_run/g4'" in outcome["dotdot"], outcome
    assert outcome["absolute"].startswith("UnsafePathError") and latest in outcome["absolute"], outcome
    assert main(["verify", str(tmp_path / "run")]) != 0
