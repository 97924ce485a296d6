"""Tests of the ``nvckpt`` command line on real checkpoints written by real training loops.

Every command runs at least once as a subprocess (``python -m nvcomp_checkpoint.cli`` and the
``nvckpt`` script); the remaining cases call ``main(argv)``, the function the script runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fresh_process
import nvcomp_checkpoint as nc
from conftest import assert_tree_equal
from nvcomp_checkpoint.cli.main import main

# -- helpers --------------------------------------------------------------------------------


def run_cli(*args: str, script: bool = False) -> subprocess.CompletedProcess[str]:
    """Run nvckpt in a fresh process, as a user would."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if script:  # the console script itself
        exe = str(Path(sys.executable).with_name("nvckpt"))
        return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    return fresh_process.run(["-m", "nvcomp_checkpoint.cli", *map(str, args)], cwd=os.getcwd(), env=env, timeout=300)


def call(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    """Run ``main(argv)`` in this process; returns (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("nvckpt: error: "), err
    for n in needles:
        assert n in lines[0], (n, err)


# -- real checkpoints -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def train_ckpt(work: Path) -> tuple[Path, dict[str, Any]]:
    """A torch.save checkpoint of a small MLP after 5 AdamW steps: bf16 weights, fp32 moments, grads."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):
        x = torch.randn(32, 256)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    ckpt = {
        "model": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "step": 5,
        "tag": "cli-test",
    }
    path = work / "plain.pt"
    torch.save(ckpt, path)
    return path, ckpt


@pytest.fixture(scope="module")
def compressed(work: Path, train_ckpt: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """``nvckpt compress`` of the training checkpoint, run as a subprocess, with its JSON report."""
    src, _ = train_ckpt
    dst = work / "plain.nvc"
    proc = run_cli("compress", src, dst, "--json")
    assert proc.returncode == 0, proc.stderr
    return dst, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def safetensors_file(work: Path, train_ckpt: tuple[Path, dict[str, Any]]) -> Path:
    from safetensors.torch import save_file

    _, ckpt = train_ckpt
    path = work / "weights.safetensors"
    save_file({k: v.float().contiguous() for k, v in ckpt["model"].items()}, str(path), metadata={"format": "pt", "run": "cli"})
    return path


@pytest.fixture(scope="module")
def lightning_ckpt(work: Path) -> Path:
    """A real Lightning checkpoint after 3 training steps."""
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self, hidden: int = 64) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(24, 32), torch.randn(24, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            default_root_dir=str(work),
        )
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    path = work / "tiny.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def hf_checkpoint(work: Path) -> Path:
    """A real HF Trainer ``checkpoint-2/`` directory of a tiny BERT (built from a config, no download)."""
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    cfg = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(0, 128, (8,), generator=g), "labels": torch.tensor(i % 2)}

    args = TrainingArguments(
        str(work / "hf"),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        logging_steps=100,
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=BertForSequenceClassification(cfg), args=args, train_dataset=Data()).train()
    path = work / "hf" / "checkpoint-2"
    assert (path / "optimizer.pt").exists() and (path / "model.safetensors").exists()
    return path


# -- compress / verify / decompress ---------------------------------------------------------


def test_compress_verify_decompress_is_bit_identical(
    work: Path, train_ckpt: tuple[Path, dict[str, Any]], compressed: tuple[Path, dict[str, Any]]
) -> None:
    src, ckpt = train_ckpt
    dst, report = compressed
    assert report["source_format"] == "torch.save"
    assert report["stored_bytes"] == dst.stat().st_size
    raw = sum(
        t.numel() * t.element_size()
        for t in [*ckpt["model"].values(), *ckpt["grads"].values()]
        + [v for s in ckpt["optimizer"]["state"].values() for v in s.values()]
    )
    assert report["raw_bytes"] == raw
    # bf16 weights through byte planes compress well (docs/facts.md: ~1.46x); the file as a whole shrinks.
    assert report["components"]["weights"]["ratio"] > 1.2
    assert report["ratio"] > 1.05 and dst.stat().st_size < src.stat().st_size

    proc = run_cli("verify", dst)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"OK {dst}") and "20 tensors" in proc.stdout

    back = work / "back.pt"
    proc = run_cli("decompress", dst, back)
    assert proc.returncode == 0, proc.stderr
    assert_tree_equal(torch.load(src, weights_only=True), torch.load(back, weights_only=True))


def test_console_script_quiet_prints_nothing(work: Path, train_ckpt: tuple[Path, dict[str, Any]]) -> None:
    src, ckpt = train_ckpt
    dst = work / "quiet.nvc"
    proc = run_cli("compress", src, dst, "--quiet", "--policy", "zstd:3", script=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    assert_tree_equal(ckpt, nc.load(dst))
    with nc.open(dst) as r:
        assert r.entry("optimizer/state/0/exp_avg").codec.level == 3


def test_existing_destination_needs_force(
    capsys: pytest.CaptureFixture[str], work: Path, train_ckpt: tuple[Path, dict[str, Any]]
) -> None:
    src, _ = train_ckpt
    dst = work / "exists.nvc"
    dst.write_bytes(b"keep me")
    code, _, err = call(capsys, "compress", src, dst)
    assert code == 2
    assert_one_line_error(err, str(dst), "--force")
    assert dst.read_bytes() == b"keep me"
    code, _, err = call(capsys, "compress", src, dst, "--force", "--quiet")
    assert code == 0 and nc.is_nvcomp_checkpoint(dst)


def test_policy_shorthand_and_json(
    capsys: pytest.CaptureFixture[str], work: Path, train_ckpt: tuple[Path, dict[str, Any]]
) -> None:
    src, ckpt = train_ckpt
    pfile = work / "policy.json"
    pfile.write_text(json.dumps({"weights": {"codec": "zstd", "level": 5}, "exp_avg": "none", "gradients": "zstd:2:none"}))
    dst = work / "policy.nvc"
    code, out, err = call(capsys, "compress", src, dst, "--policy", pfile, "--json")
    assert code == 0, err
    assert json.loads(out)["policy"]["weights"]["level"] == 5
    with nc.open(dst) as r:
        w = r.entry("model/0.weight")
        assert (w.codec.id, w.codec.level, w.filter) == ("zstd", 5, "byteplane")
        assert r.entry("optimizer/state/0/exp_avg").codec.id == "none"
        g = r.entry("grads/0.weight")
        assert (g.codec.id, g.codec.level, g.filter) == ("zstd", 2, "none")
    assert_tree_equal(ckpt, nc.load(dst))

    inline = work / "inline.nvc"
    code, _, err = call(capsys, "compress", src, inline, "--quiet", "--policy", '{"exp_avg_sq": {"codec": "zstd", "level": 4}}')
    assert code == 0, err
    with nc.open(inline) as r:
        assert r.entry("optimizer/state/0/exp_avg_sq").codec.level == 4
        assert r.entry("optimizer/state/0/exp_avg").codec.level == 1  # the default for the rest


def test_recompress_our_file_keeps_source_metadata(
    capsys: pytest.CaptureFixture[str],
    work: Path,
    compressed: tuple[Path, dict[str, Any]],
    train_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    src, _ = compressed
    dst = work / "raw.nvc"
    code, _, err = call(capsys, "compress", src, dst, "--policy", "none", "--quiet")
    assert code == 0, err
    with nc.open(dst) as r:
        assert {e.codec.id for e in r.index.tensors} == {"none"}
        assert r.metadata["source_file"] == "plain.pt"
    assert_tree_equal(train_ckpt[1], nc.load(dst))


def test_safetensors_round_trip_keeps_format_and_metadata(
    capsys: pytest.CaptureFixture[str], work: Path, safetensors_file: Path
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    dst = work / "weights.nvc"
    code, out, err = call(capsys, "compress", safetensors_file, dst, "--json")
    assert code == 0, err
    assert json.loads(out)["source_format"] == "safetensors"
    back = work / "weights_back.safetensors"
    code, out, err = call(capsys, "decompress", dst, back)  # auto: back to safetensors
    assert code == 0, err
    assert "(safetensors)" in out
    a, b = load_file(str(safetensors_file)), load_file(str(back))
    assert_tree_equal(dict(sorted(a.items())), dict(sorted(b.items())))
    with safe_open(str(back), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "run": "cli"}


def test_lightning_ckpt_round_trip(capsys: pytest.CaptureFixture[str], work: Path, lightning_ckpt: Path) -> None:
    dst = work / "tiny.nvc"
    code, _, err = call(capsys, "compress", lightning_ckpt, dst, "--quiet")
    assert code == 0, err
    code, out, _ = call(capsys, "inspect", dst, "--json")
    info = json.loads(out)
    comps = {t["key"]: t["component"] for t in info["tensors"]}
    assert comps["optimizer_states/0/state/0/exp_avg"] == "exp_avg"
    assert comps["state_dict/net.0.weight"] == "weights"
    back = work / "tiny_back.ckpt"
    code, _, err = call(capsys, "decompress", dst, back)
    assert code == 0, err
    assert_tree_equal(torch.load(lightning_ckpt, weights_only=True), torch.load(back, weights_only=True))


def test_hf_checkpoint_directory_round_trip(work: Path, hf_checkpoint: Path) -> None:
    from safetensors.torch import load_file

    out = work / "hf_nvc"
    proc = run_cli("compress", hf_checkpoint, out, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["file"]: r for r in json.loads(proc.stdout)["files"]}
    assert rows["model.safetensors"]["output"] == "model.safetensors.nvc"
    assert rows["optimizer.pt"]["action"] == "compressed"
    # Pickles of Python objects (training_args.bin, rng_state.pth) are copied, never unpickled.
    assert rows["training_args.bin"]["action"] == "copied"
    names = sorted(p.name for p in out.iterdir())
    assert "optimizer.pt.nvc" in names and "optimizer.pt" not in names and "config.json" in names
    for name in ("config.json", "trainer_state.json", "training_args.bin"):
        assert (out / name).read_bytes() == (hf_checkpoint / name).read_bytes()

    proc = run_cli("verify", out, "--json")
    assert proc.returncode == 0, proc.stdout
    result = json.loads(proc.stdout)
    assert result["ok"] and result["files"] == 2

    back = work / "hf_back"
    proc = run_cli("decompress", out, back)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in hf_checkpoint.iterdir())
    assert_tree_equal(
        torch.load(hf_checkpoint / "optimizer.pt", weights_only=True), torch.load(back / "optimizer.pt", weights_only=True)
    )
    a, b = load_file(str(hf_checkpoint / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert_tree_equal(dict(sorted(a.items())), dict(sorted(b.items())))
    for p in hf_checkpoint.iterdir():
        if p.name not in ("optimizer.pt", "model.safetensors"):
            assert (back / p.name).read_bytes() == p.read_bytes(), p.name


def test_bench_and_estimate_on_directories(capsys: pytest.CaptureFixture[str], work: Path, hf_checkpoint: Path) -> None:
    code, out, err = call(capsys, "bench", hf_checkpoint, "--sample-mb", "0.25", "--repeat", "1", "--codecs", "zstd:1", "--json")
    assert code == 0, err
    comps = json.loads(out)["components"]
    # model.safetensors and optimizer.pt are measured; the pickles of Python objects are skipped.
    assert {"weights", "exp_avg", "exp_avg_sq"} <= set(comps)
    out_dir = work / "hf_for_estimate"
    code, _, err = call(capsys, "compress", hf_checkpoint, out_dir, "--quiet")
    assert code == 0, err
    code, out, _ = call(capsys, "estimate", *SEED, "--from", out_dir, "--json")
    e = json.loads(out)
    total = sum(p.stat().st_size for p in out_dir.iterdir())
    raw = sum(p.stat().st_size for p in out_dir.iterdir() if not p.name.endswith(".nvc"))
    for p in out_dir.glob("*.nvc"):
        with nc.open(p) as r:
            raw += r.raw_bytes
    assert e["inputs"]["ratio"] == pytest.approx(raw / total, rel=1e-4)


def test_fsspec_urls(capsys: pytest.CaptureFixture[str], train_ckpt: tuple[Path, dict[str, Any]]) -> None:
    import fsspec

    src, ckpt = train_ckpt
    fs = fsspec.filesystem("memory")
    fs.pipe("/nvckpt-cli-test/plain.pt", src.read_bytes())
    try:
        code, _, err = call(capsys, "compress", "memory://nvckpt-cli-test/plain.pt", "memory://nvckpt-cli-test/c.nvc", "--quiet")
        assert code == 0, err
        code, out, _ = call(capsys, "verify", "memory://nvckpt-cli-test/c.nvc")
        assert code == 0 and out.startswith("OK")
        code, _, err = call(capsys, "decompress", "memory://nvckpt-cli-test/c.nvc", "memory://nvckpt-cli-test/back.pt", "--quiet")
        assert code == 0, err
        with fs.open("/nvckpt-cli-test/back.pt", "rb") as f:
            assert_tree_equal(ckpt, torch.load(f, weights_only=True))
    finally:
        fs.rm("/nvckpt-cli-test", recursive=True)


# -- inspect ----------------------------------------------------------------------------------


def test_inspect_our_file_matches_the_reader(compressed: tuple[Path, dict[str, Any]]) -> None:
    path, _ = compressed
    proc = run_cli("inspect", path, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    with nc.open(path) as r:
        assert [t["key"] for t in info["tensors"]] == r.keys()
        assert info["file_bytes"] == r.file_bytes and info["raw_bytes"] == r.raw_bytes
        summary = r.summary()
        assert sorted(info["components"]) == sorted(summary)
        for name, stats in summary.items():
            got = info["components"][name]
            assert (got["tensors"], got["raw_bytes"], got["stored_bytes"]) == (stats.tensors, stats.raw_bytes, stats.stored_bytes)
            assert got["codecs"] == list(stats.codecs)  # one naming: "zstd:1", "none"
        for t in info["tensors"]:
            e = r.entry(t["key"])
            assert t["stored_bytes"] == e.stored_bytes and t["component"] == e.component
            assert t["shape"] == list(e.shape)
    assert info["metadata"]["source_format"] == "torch.save"


def test_inspect_text_shows_tree_and_table(capsys: pytest.CaptureFixture[str], compressed: tuple[Path, dict[str, Any]]) -> None:
    path, _ = compressed
    code, out, _ = call(capsys, "inspect", path)
    assert code == 0
    assert "optimizer/" in out and "exp_avg_sq  float32[512x256]" in out and "zstd:1/byteplane" in out
    for header in ("component", "tensors", "raw", "stored", "ratio", "codec", "filter", "total (file)"):
        assert header in out
    code, out, _ = call(capsys, "inspect", path, "--depth", "1")
    assert "optimizer/  (12 tensors" in out and "exp_avg_sq  float32" not in out


def test_inspect_plain_formats(
    capsys: pytest.CaptureFixture[str], train_ckpt: tuple[Path, dict[str, Any]], safetensors_file: Path, hf_checkpoint: Path
) -> None:
    src, ckpt = train_ckpt
    code, out, _ = call(capsys, "inspect", src, "--json")
    assert code == 0
    info = json.loads(out)
    assert info["format"] == "torch.save"
    assert info["components"]["exp_avg"]["tensors"] == 4
    assert info["components"]["exp_avg"]["raw_bytes"] == sum(
        s["exp_avg"].numel() * 4 for s in ckpt["optimizer"]["state"].values()
    )

    code, out, _ = call(capsys, "inspect", safetensors_file, "--json")
    info = json.loads(out)
    assert info["format"] == "safetensors" and info["metadata"] == {"format": "pt", "run": "cli"}
    shapes = {t["key"]: t["shape"] for t in info["tensors"]}
    assert shapes["0.weight"] == [512, 256] and shapes["2.bias"] == [256]
    assert info["raw_bytes"] == sum(t.numel() * 4 for t in ckpt["model"].values())

    code, out, _ = call(capsys, "inspect", hf_checkpoint, "--json")
    info = json.loads(out)
    files = {f["file"]: f for f in info["files"]}
    assert files["model.safetensors"]["format"] == "safetensors"
    assert files["optimizer.pt"]["components"]["exp_avg"]["tensors"] > 0
    assert "--trust" in files["training_args.bin"]["note"]


# -- verify ----------------------------------------------------------------------------------


def test_verify_names_the_corrupt_tensor(
    capsys: pytest.CaptureFixture[str], work: Path, compressed: tuple[Path, dict[str, Any]]
) -> None:
    src, _ = compressed
    bad = work / "bad.nvc"
    shutil.copy(src, bad)
    key = "optimizer/state/2/exp_avg_sq"
    with nc.open(bad) as r:
        frame = r.entry(key).frames[1]
    data = bytearray(bad.read_bytes())
    data[frame.offset + frame.size // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    proc = run_cli("verify", bad)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
    assert any(key in ln and "checksum" in ln for ln in failed), proc.stdout
    assert sum(key in ln for ln in failed) == 1  # only the damaged tensor
    with nc.open(src) as r:
        n = len(r.keys())
    assert failed[-1] == f"FAILED {bad}: 1 problem in {n} tensors", failed

    truncated = work / "truncated.nvc"
    truncated.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    proc = run_cli("verify", truncated)
    assert proc.returncode == 1
    assert (
        proc.stdout.splitlines()[-1]
        == f"FAILED {truncated}: the file is unreadable (its index cannot be read), so no tensor was checked"
    )
    code, out, _ = call(capsys, "verify", truncated, "--json")
    assert code == 1
    result = json.loads(out)
    assert not result["ok"] and "truncated" in result["failures"][0]["error"]


# -- bench -----------------------------------------------------------------------------------


def test_bench_recommends_by_the_pipelined_rule(
    capsys: pytest.CaptureFixture[str], work: Path, train_ckpt: tuple[Path, dict[str, Any]]
) -> None:
    src, ckpt = train_ckpt
    png = work / "bench.png"
    saved = work / "recommended.json"
    # 1 MB/s storage: every codec outruns it, so compression must win on every large component.
    proc = run_cli(
        "bench",
        src,
        "--sample-mb",
        "1",
        "--repeat",
        "1",
        "--storage-gbps",
        "0.001",
        "--json",
        "--plot",
        png,
        "--save-policy",
        saved,
        "--force",  # a 1 MiB sample, on a machine the suite keeps busy: saved all the same
    )
    assert proc.returncode == 0, proc.stderr
    slow = json.loads(proc.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    comps = slow["components"]
    assert set(comps) == {"weights", "exp_avg", "exp_avg_sq", "gradients", "other"}
    cands = comps["weights"]["candidates"]
    assert {(c["codec"], c["level"], c["filter"]) for c in cands} == {
        ("zstd", lv, f) for lv in (1, 3) for f in ("byteplane", "none")
    } | {("zstd", 1, "rotplane")}
    for c in cands:
        assert c["ratio"] > 1.0 and c["compress_gbps"] > 0 and c["decompress_gbps"] > 0
    assert comps["other"]["candidates"] == []  # only 4-byte step counters: stored raw
    for name in ("weights", "exp_avg", "exp_avg_sq", "gradients"):
        choice = slow["recommended"]["choices"][name]
        assert choice["codec"] == "zstd", (name, choice)
        best = min(comps[name]["candidates"], key=lambda c: c["write_s"])
        assert choice["write_s"] == pytest.approx(best["write_s"])
        raw = comps[name]["raw_bytes"]
        expected = max(raw / (choice["compress_gbps"] * 1e9), raw / choice["ratio"] / 1e6)
        assert choice["write_s"] == pytest.approx(expected)
    assert slow["recommended"]["write_s"] < slow["recommended"]["raw_write_s"]
    assert json.loads(saved.read_text()) == slow["recommended_policy"]

    # The saved policy drives compress as is.
    dst = work / "bench_policy.nvc"
    code, _, err = call(capsys, "compress", src, dst, "--policy", saved, "--quiet")
    assert code == 0, err
    with nc.open(dst) as r:
        w = r.entry("model/0.weight")
        assert (w.codec.id, w.codec.level, w.filter) == (
            slow["recommended_policy"]["weights"]["codec"],
            slow["recommended_policy"]["weights"]["level"],
            slow["recommended_policy"]["weights"]["filter"],
        )
    assert_tree_equal(ckpt, nc.load(dst))

    # A 100 TB/s storage outruns every codec of this machine: store everything raw.
    code, out, _ = call(
        capsys,
        "bench",
        src,
        "--sample-mb",
        "0.5",
        "--repeat",
        "1",
        "--storage-gbps",
        "100000",
        "--codecs",
        "zstd:1",
        "--portable",
    )
    assert code == 0
    assert "recommended at 100000 GB/s: weights=none/none, exp_avg=none/none" in out

    # estimate --from a bench output re-picks for its own storage speed.
    bench_json = work / "bench.json"
    bench_json.write_text(proc.stdout)
    code, out, _ = call(
        capsys,
        "estimate",
        "--checkpoint-gb",
        "100",
        "--gpus",
        "8",
        "--gpu-hour-usd",
        "4.4",
        "--storage-gbps",
        "0.001",
        "--interval-min",
        "30",
        "--retain",
        "4",
        "--storage-usd-gb-month",
        "0.1",
        "--from",
        bench_json,
        "--json",
    )
    est = json.loads(out)
    assert est["inputs"]["ratio"] == pytest.approx(slow["recommended"]["ratio"], rel=1e-3)
    assert est["inputs"]["codec_gbps"] == pytest.approx(slow["recommended"]["compress_gbps"], rel=1e-3)


# -- estimate --------------------------------------------------------------------------------

SEED = [
    "--checkpoint-gb",
    "782",
    "--gpus",
    "8",
    "--gpu-hour-usd",
    "4.40",
    "--storage-gbps",
    "5",
    "--interval-min",
    "30",
    "--retain",
    "96",
    "--storage-usd-gb-month",
    "0.14",
]


def test_estimate_reproduces_the_seed_worked_example() -> None:
    proc = run_cli("estimate", *SEED, "--ratio", "1.27", "--codec-gbps", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    e = json.loads(proc.stdout)
    # "782 GB / 5 GB/s = 156.4 s"; "156.4 s x 48/day x 30 days = 225,216 s = 62.6 h"; "$2,203/month"
    assert e["checkpoints_per_month"] == 1440
    assert e["without"]["write_s"] == pytest.approx(156.4)
    assert e["without"]["idle_hours_month"] * 3600 == pytest.approx(225216, abs=1)
    assert round(e["without"]["idle_hours_month"], 1) == 62.6
    assert e["without"]["idle_usd_month"] == pytest.approx(2203, abs=1.5)
    assert e["written_gb_month"] / 1e6 == pytest.approx(1.13, abs=0.005)  # "1.13 PB a month"
    # "compress 782 GB at ~16 GB/s (about 49 s), write 616 GB (123 s) -> about 123 s"
    assert e["with"]["compress_s"] == pytest.approx(48.9, abs=0.05)
    assert round(e["with"]["checkpoint_gb"]) == 616
    assert e["with"]["write_s"] == pytest.approx(123.1, abs=0.05) and e["compression_hidden"]
    # "21% smaller, 33 s faster per checkpoint, 13+ hours a month reclaimed"
    assert round(e["saving"]["size_percent"]) == 21 and round(e["saving"]["write_s"]) == 33
    assert 13 < e["saving"]["idle_hours_month"] < 14
    # The first row of the seed's table: ~$2,700/month = storage (96 kept) + GPU idle.
    storage = 96 * (782 - 782 / 1.27) * 0.14
    assert e["saving"]["storage_usd_month"] == pytest.approx(storage, abs=0.01)
    assert e["saving"]["total_usd_month"] == pytest.approx(storage + e["saving"]["idle_usd_month"], abs=0.01)
    assert round(e["saving"]["total_usd_month"], -2) == 2700


@pytest.mark.parametrize(
    ("gb", "gpus", "ratio", "codec", "seed_saving", "digits"),
    [
        (782, 8, 1.25, 181, 2500, -2),  # Llama 3 70B, 8 GPUs, ANS
        (782, 64, 1.27, 16, 6000, -3),  # 64 GPUs, ZSTD
        (782, 64, 1.25, 181, 5600, -2),  # 64 GPUs, ANS
        (4529, 128, 1.27, 16, 56000, -3),  # Llama 3 405B
        (4529, 128, 1.25, 181, 53000, -3),
        (1575, 64, 1.40, 16, 16000, -3),  # Mixtral 8x22B (MoE)
        (1575, 64, 1.39, 181, 16000, -3),
        (7490, 256, 1.40, 16, 222000, -3),  # DeepSeek-V3
        (7490, 256, 1.39, 181, 218000, -3),
    ],
)
def test_estimate_reproduces_the_seed_savings_tables(
    capsys: pytest.CaptureFixture[str], gb: int, gpus: int, ratio: float, codec: int, seed_saving: int, digits: int
) -> None:
    args = [
        "--checkpoint-gb",
        gb,
        "--gpus",
        gpus,
        "--gpu-hour-usd",
        "4.40",
        "--storage-gbps",
        "5",
        "--interval-min",
        "30",
        "--retain",
        "96",
        "--storage-usd-gb-month",
        "0.14",
        "--ratio",
        ratio,
        "--codec-gbps",
        codec,
        "--json",
    ]
    code, out, _ = call(capsys, "estimate", *args)
    assert code == 0
    assert round(json.loads(out)["saving"]["total_usd_month"], digits) == seed_saving


@pytest.mark.parametrize(
    ("storage", "ratio", "codec", "seconds", "change"),
    [
        (5, 1.25, 181, 125, -20),
        (15, 1.27, 16, 49, -6),
        (15, 1.25, 181, 42, -20),
        (25, 1.27, 16, 49, 57),
        (25, 1.25, 181, 25, -20),
    ],
)
def test_estimate_reproduces_the_seed_storage_speed_table(
    capsys: pytest.CaptureFixture[str], storage: float, ratio: float, codec: float, seconds: int, change: int
) -> None:
    args = [*SEED, "--ratio", ratio, "--codec-gbps", codec, "--json"]
    args[args.index("--storage-gbps") + 1] = str(storage)
    code, out, _ = call(capsys, "estimate", *args)
    e = json.loads(out)
    assert round(e["with"]["write_s"]) == seconds
    # The seed rounds the times before the percentage (49 s / 31 s = +57%).
    assert abs(-e["saving"]["write_percent"] - change) <= 1.5
    # Hidden only where the codec outruns the storage; at 15 GB/s ZSTD is slower yet still saves 6%.
    assert e["compression_hidden"] == (782 / codec <= 782 / ratio / storage)


def test_estimate_text_and_from_checkpoint(capsys: pytest.CaptureFixture[str], compressed: tuple[Path, dict[str, Any]]) -> None:
    code, out, _ = call(capsys, "estimate", *SEED, "--ratio", "1.27", "--codec-gbps", "16")
    assert code == 0
    assert "156.4 s" in out and "123.1 s" in out and "$2,202" in out and "hidden behind" in out
    path, report = compressed
    code, out, _ = call(capsys, "estimate", *SEED, "--from", path, "--json")
    e = json.loads(out)
    with nc.open(path) as r:
        assert e["inputs"]["ratio"] == pytest.approx(r.raw_bytes / r.file_bytes, rel=1e-4)
    assert e["inputs"]["codec_gbps"] is None


# -- user mistakes: one line, non-zero, no traceback --------------------------------------------


def test_errors_in_a_subprocess(work: Path, train_ckpt: tuple[Path, dict[str, Any]]) -> None:
    proc = run_cli("inspect", work / "missing.pt")
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, "missing.pt", "no such file")
    if not nc.gpu_available():
        proc = run_cli("compress", train_ckpt[0], work / "ans.nvc", "--policy", "ans")
        assert proc.returncode == 2
        assert_one_line_error(proc.stderr, "'ans'", "CUDA", "zstd")
        assert not (work / "ans.nvc").exists()


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["compress", "@src", "@work/x.nvc", "--policy", "lz77"], ["unknown codec 'lz77'", "zstd"]),
        (["compress", "@src", "@work/x.nvc", "--policy", "zstd:fast"], ["'fast'", "CODEC[:LEVEL][:FILTER]"]),
        (["compress", "@src", "@work/x.nvc", "--policy", "{bad json"], ["not valid JSON"]),
        (["compress", "@src", "@work/x.nvc", "--policy", '{"weight": "zstd"}'], ["unknown key(s) 'weight'", "weights"]),
        (["inspect", "@work/notes.txt"], ["notes.txt", "not a checkpoint"]),
        (["decompress", "@src", "@work/y.pt"], ["plain.pt", "not an nvcomp-checkpoint file"]),
        (["verify", "@src"], ["plain.pt", "nvckpt compress"]),
        (["decompress", "@nvc", "@work/y.safetensors"], ["--to torch"]),
        (["estimate", *SEED, "--ratio", "0"], ["--ratio must be a positive number"]),
        (["estimate", *SEED, "--from", "@src"], ["no measured compression ratio"]),
        (["bench", "@src", "--storage-gbps", "0"], ["--storage-gbps must be positive"]),
    ],
)
def test_user_mistakes(
    capsys: pytest.CaptureFixture[str],
    work: Path,
    train_ckpt: tuple[Path, dict[str, Any]],
    compressed: tuple[Path, dict[str, Any]],
    argv: list[str],
    needles: list[str],
) -> None:
    (work / "notes.txt").write_text("not a checkpoint\n")
    fill = {"src": str(train_ckpt[0]), "work": str(work), "nvc": str(compressed[0])}
    for key, value in fill.items():
        argv = [a.replace(f"@{key}", value) for a in argv]
    code, out, err = call(capsys, *argv)
    assert code == 2
    assert_one_line_error(err, *needles)
    assert not (work / "x.nvc").exists() and not (work / "y.pt").exists() and not (work / "y.safetensors").exists()


def test_ratio_and_from_are_exclusive(capsys: pytest.CaptureFixture[str], compressed: tuple[Path, dict[str, Any]]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["estimate", *SEED, "--ratio", "1.3", "--from", str(compressed[0])])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def _as_gpu_only_file(path: Path) -> None:
    """Relabel a file written with codec `none` as nvCOMP ANS: what a GPU machine writes, as far
    as portability goes (every frame is stored raw, so only the codec id changes)."""
    import xxhash

    from nvcomp_checkpoint.format.layout import FOOTER, pack_footer

    data = path.read_bytes()
    offset, size, _, _ = FOOTER.unpack(data[-FOOTER.size :])
    index = json.loads(data[offset : offset + size])
    for t in index["tensors"]:
        t["codec"] = {"id": "ans"}
    blob = json.dumps(index, separators=(",", ":")).encode()
    path.write_bytes(data[:offset] + blob + pack_footer(offset, len(blob), xxhash.xxh3_64_intdigest(blob)))


def test_inspect_says_whether_the_file_loads_without_a_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "w.nvc"
    nc.save({"w": torch.randn(64, 64)}, path)
    code, out, _ = call(capsys, "inspect", str(path))
    assert code == 0 and "loads anywhere" in out
    assert json.loads(run_cli("inspect", path, "--json").stdout)["portable"] is True

    nc.save({"w": torch.randn(64, 64)}, path, policy=nc.CodecPolicy.uniform("none"))
    _as_gpu_only_file(path)
    code, out, _ = call(capsys, "inspect", str(path))
    assert code == 0 and "needs a CUDA GPU" in out and "ans" in out
    info = json.loads(run_cli("inspect", path, "--json").stdout)
    assert info["portable"] is False and info["gpu_only_codecs"] == ["ans"]
    if not nc.gpu_available():
        with pytest.raises(nc.errors.CodecUnavailableError, match=r"'w'.*'ans'.*CUDA"):
            nc.load(path)


def test_failed_directory_replace_puts_the_old_directory_back(tmp_path: Path) -> None:
    from nvcomp_checkpoint.cli.convert import _commit_dir

    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(OSError):
        _commit_dir(tmp_path / "staging-that-vanished", str(target))
    assert (target / "keep.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# -- damaged inputs and bad options: one line, exit 2, nothing written -------------------------


def _safetensors_bytes(header: dict[str, Any], data: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return len(blob).to_bytes(8, "little") + blob + data


@pytest.mark.parametrize(
    ("header", "data", "needles"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": 5}}, bytes(8), ["'w'", "data_offsets"]),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, bytes(8), ["'w'", "data_offsets"]),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, "8"]}}, bytes(8), ["'w'", "data_offsets"]),
        ({"w": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), ["'w'", "dtype 'XX'"]),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), ["'w'", "shape"]),
        ({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, bytes(8), ["'w'", "shape"]),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), ["'w'", "12 bytes"]),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8), ["'w'", "data_offsets"]),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 10**12]}}, bytes(8), ["'w'", "data_offsets"]),
        ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), ["'w'", "data_offsets"]),
        ({"w": [1, 2]}, bytes(8), ["'w'"]),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            ["overlap"],
        ),
        ({"__metadata__": ["x"], "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), ["__metadata__"]),
    ],
    ids=[
        "offsets-int",
        "offsets-one",
        "offsets-str",
        "dtype",
        "shape-negative",
        "shape-str",
        "size-mismatch",
        "offsets-reversed",
        "offsets-past-end",
        "offsets-missing",
        "entry-list",
        "overlap",
        "metadata-list",
    ],
)
def test_damaged_safetensors_header(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, header: dict[str, Any], data: bytes, needles: list[str]
) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = folder / "model.safetensors"
    path.write_bytes(_safetensors_bytes(header, data))
    for argv in (
        ["inspect", path],
        ["inspect", folder],
        ["bench", path, "--codecs", "zstd:1"],
        ["bench", folder, "--codecs", "zstd:1"],
        ["compress", path, tmp_path / "x.nvc"],
    ):
        code, _, err = call(capsys, *argv)
        assert code == 2, (argv, err)
        assert_one_line_error(err, "model.safetensors", *needles)
    assert not (tmp_path / "x.nvc").exists()


def test_truncated_safetensors_is_reported_damaged(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.randn(1000)}, str(path))
    code, _, err = call(capsys, "inspect", path)
    assert code == 0, err
    path.write_bytes(path.read_bytes()[:-100])
    for argv in (["inspect", path], ["bench", path, "--codecs", "zstd:1"], ["compress", path, tmp_path / "x.nvc"]):
        code, _, err = call(capsys, *argv)
        assert code == 2, (argv, err)
        assert_one_line_error(err, "w.safetensors", "truncated")
    assert not (tmp_path / "x.nvc").exists()


def test_safetensors_edge_cases_still_read(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "edge.safetensors"
    tensors = {
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(1.5),
        "flag": torch.tensor([True, False]),
        "fp8": torch.randn(16).to(torch.float8_e4m3fn),
        "big": torch.randn(2048),
    }
    save_file(tensors, str(path), metadata={"k": "v"})
    code, out, err = call(capsys, "inspect", path, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert {t["key"]: t["raw_bytes"] for t in info["tensors"]} == {k: v.numel() * v.element_size() for k, v in tensors.items()}
    code, _, err = call(capsys, "bench", path, "--codecs", "zstd:1", "--repeat", "1", "--json")
    assert code == 0, err


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_workers_must_be_positive(capsys: pytest.CaptureFixture[str], tmp_path: Path, workers: str) -> None:
    src = tmp_path / "w.pt"
    torch.save({"w": torch.randn(4096)}, src)
    folder = tmp_path / "d"
    folder.mkdir()
    torch.save({"w": torch.randn(4096)}, folder / "w.pt")
    for argv in (["compress", src, tmp_path / "x.nvc"], ["compress", folder, tmp_path / "xd"], ["bench", src]):
        code, _, err = call(capsys, *argv, "--workers", workers)
        assert code == 2, (argv, err)
        assert_one_line_error(err, "--workers", "positive", workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "w.pt"]


@pytest.mark.parametrize(
    ("policy", "needles"),
    [
        ('{"device": 5}', ["device", "str"]),
        ('{"min_compress_bytes": "x"}', ["min_compress_bytes", "int"]),
        ('{"min_compress_bytes": -1}', ["min_compress_bytes", "-1"]),
        ('{"min_compress_bytes": true}', ["min_compress_bytes", "int"]),
        ('{"weights": 5}', ["weights", "CodecSpec"]),
        ('{"weights": {"codec": "zstd", "level": "3"}}', ["weights", "level", "int"]),
        ('{"weights": {"codec": 3}}', ["weights", "codec", "str"]),
        ('{"overrides": 5}', ["overrides", "dict"]),
        ('{"overrides": {"w*": 5}}', ["overrides", "'w*'", "CodecSpec"]),
        ('{"patterns": 3}', ["patterns", "dict"]),
        ('{"patterns": {"w*": 3}}', ["patterns", "'w*'"]),
        ('{"choose_rotation": "yes"}', ["choose_rotation", "bool"]),  # every CodecPolicy field is a key
    ],
)
def test_policy_fields_are_checked_before_reading_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, policy: str, needles: list[str]
) -> None:
    # The source does not exist: a policy error, not "no such file", proves the policy is checked first.
    code, _, err = call(capsys, "compress", tmp_path / "missing.pt", tmp_path / "x.nvc", "--policy", policy)
    assert code == 2, err
    assert_one_line_error(err, "--policy", *needles)
    assert not (tmp_path / "x.nvc").exists()


def test_codec_policy_checks_field_types_at_construction() -> None:
    with pytest.raises(ValueError, match="min_compress_bytes.*int"):
        nc.CodecPolicy(min_compress_bytes="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device.*str"):
        nc.CodecPolicy(device=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_compress_bytes"):
        nc.CodecPolicy(min_compress_bytes=-1)
    assert nc.CodecPolicy(min_compress_bytes=0).min_compress_bytes == 0


def test_decompress_shared_storage_to_safetensors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    w = torch.randn(4, 4)
    tied = tmp_path / "tied.nvc"
    nc.save({"a": w, "b": w}, tied)
    code, _, err = call(capsys, "decompress", tied, tmp_path / "tied.safetensors")
    assert code == 2, err
    assert_one_line_error(err, "tied.nvc", "share memory", "'a'", "'b'", "--to torch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tied.nvc"]
    code, _, err = call(capsys, "decompress", tied, tmp_path / "tied.pt", "--to", "torch")
    assert code == 0, err
    back = torch.load(tmp_path / "tied.pt", weights_only=True)
    assert torch.equal(back["a"], w) and back["a"].data_ptr() == back["b"].data_ptr()

    # Views of one storage that do not overlap are fine for safetensors.
    halves = tmp_path / "halves.nvc"
    nc.save({"a": w[:2], "b": w[2:]}, halves)
    code, _, err = call(capsys, "decompress", halves, tmp_path / "halves.safetensors")
    assert code == 0, err
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "halves.safetensors"))
    assert torch.equal(back["a"], w[:2]) and torch.equal(back["b"], w[2:])


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, a directory nobody can create files in")
def test_decompress_unwritable_destination_names_it(
    capsys: pytest.CaptureFixture[str], compressed: tuple[Path, dict[str, Any]]
) -> None:
    for dst in ("/proc/nvckpt-test-x.pt", "/proc/nvckpt-test-missing/x.pt"):
        code, _, err = call(capsys, "decompress", compressed[0], dst)
        assert code == 2, err
        assert_one_line_error(err, f"{dst}: ")
        assert ".tmp-" not in err and "nvckpt-tmp" not in err, err


@pytest.mark.parametrize("held", [[], ["train.py", "notes.txt"]])
def test_inspect_of_a_folder_without_checkpoints_is_an_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, held: list[str]
) -> None:
    for name in held:
        (tmp_path / name).write_text("x = 1\n")
    code, out, err = call(capsys, "inspect", tmp_path)
    assert code == 2 and out == "", out
    assert_one_line_error(err, str(tmp_path), "not a checkpoint folder", "notes.txt, train.py" if held else "it is empty")


def test_verify_of_many_files_says_which_file_of_how_many(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each file's bar (on a terminal, after a second) names its place among the files verified.
    from nvcomp_checkpoint.cli import _ui

    shown: list[str] = []
    start = _ui.Reporter.start
    monkeypatch.setattr(_ui.Reporter, "start", lambda self, text, total=None: shown.append(text) or start(self, text, total))
    for i in range(3):
        nc.save({"w": torch.full((64,), float(i))}, tmp_path / f"part{i}.nvc")
    code, _, err = call(capsys, "verify", tmp_path)
    assert code == 0, err
    assert sorted(shown) == [f"verifying part{i}.nvc ({i + 1}/3)" for i in range(3)], shown
    shown.clear()
    assert call(capsys, "verify", tmp_path / "part0.nvc")[0] == 0
    assert shown == ["verifying part0.nvc"]
