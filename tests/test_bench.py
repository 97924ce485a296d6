"""``nvckpt bench``: why it recommends ``none``, and a plot whose labels can be read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nvcomp_checkpoint.cli.bench import plot_figure, recommend, why_none
from nvcomp_checkpoint.cli.main import main
from nvcomp_checkpoint.filters import KERNELS


def _candidate(codec: str, level: int | None, filt: str, ratio: float, gbps: float) -> dict:
    return {
        "codec": codec,
        "level": level,
        "filter": filt,
        "device": "cpu",
        "ratio": ratio,
        "compress_gbps": gbps,
        "decompress_gbps": gbps,
    }


def _components() -> dict:
    return {
        "weights": {
            "raw_bytes": 1 << 30,
            "candidates": [_candidate("zstd", 1, "byteplane", 1.46, 0.4), _candidate("zstd", 3, "byteplane", 1.48, 0.2)],
        },
        "exp_avg": {"raw_bytes": 2 << 30, "candidates": [_candidate("zstd", 1, "byteplane", 1.0, 0.5)]},
    }


def test_none_is_explained_by_the_codec_being_slower_than_the_storage() -> None:
    comps = _components()
    rec = recommend(comps, storage_gbps=5.0)
    assert {k: v["codec"] for k, v in rec["choices"].items()} == {"weights": "none", "exp_avg": "none"}
    reasons = why_none(comps, rec, 5.0, "2 CPU threads")
    # The fastest shrinking codec sets the break-even storage speed.
    assert "zstd:1/byteplane, 0.4 GB/s on 2 CPU threads) is slower than the storage (5 GB/s)" in reasons["weights"]
    assert "storage slower than 0.4 GB/s" in reasons["weights"]
    assert reasons["exp_avg"] == "exp_avg: none, because no codec made it smaller"
    # Below that speed the codec is recommended, and nothing needs explaining.
    slow = recommend(comps, storage_gbps=0.3)
    assert slow["choices"]["weights"]["codec"] == "zstd"
    assert set(why_none(comps, slow, 0.3, "2 CPU threads")) == {"exp_avg"}


def test_bench_prints_why_it_recommends_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.randn(256, 256).to(torch.bfloat16)}, path)
    # No CPU compresses at 10 TB/s: every component is stored raw, and the output says why.
    assert main(["bench", str(path), "--storage-gbps", "10000", "--codecs", "zstd:1", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "recommended at 10000 GB/s: weights=none/none" in out
    assert "weights: none, because the fastest codec (zstd:1/byteplane" in out and "slower than the storage" in out
    assert main(["bench", str(path), "--storage-gbps", "10000", "--codecs", "zstd:1", "--repeat", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["recommended"]["why_none"]["weights"].startswith("weights: none, because the fastest codec")
    # Which byte-plane code ran is part of the result (the numpy fallback is slower on load).
    assert result["plane_kernels"] == KERNELS


@pytest.fixture
def small_ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.randn(256, 256)}, path)
    return path


def _bench(path: Path, *more: str) -> int:
    return main(["bench", str(path), "--codecs", "zstd:1", "--repeat", "1", *more])


def test_a_busy_machine_is_named_and_its_policy_not_saved(
    small_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The load average is the machine's: set here, as no test can make the machine busy on demand.
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 64.0, 64.0))
    saved = tmp_path / "policy.json"
    assert _bench(small_ckpt, "--save-policy", str(saved)) == 2
    err = capsys.readouterr().err
    assert "not written, the measurement is unreliable: this machine is busy (load average 64.0 on" in err, err
    assert "--force writes it anyway" in err and not saved.exists()

    assert _bench(small_ckpt, "--save-policy", str(saved), "--force") == 0
    out, err = capsys.readouterr()
    assert "warning: this machine is busy" in err and saved.exists(), err
    assert _bench(small_ckpt, "--json") == 0
    assert json.loads(capsys.readouterr().out)["unreliable"][0].startswith("this machine is busy")


def test_a_small_sample_is_named_and_its_policy_not_saved(
    small_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    saved = tmp_path / "policy.json"
    assert _bench(small_ckpt, "--save-policy", str(saved)) == 2  # 256 KiB of weights
    err = capsys.readouterr().err
    assert "the sample is small (0.25 MiB of the largest component)" in err and "--sample-mb 4" in err, err
    assert not saved.exists()
    assert _bench(small_ckpt) == 0  # without --save-policy: measured, with the warning
    assert "warning: the sample is small" in capsys.readouterr().err


def test_an_idle_machine_and_a_large_sample_save_the_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    path = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(4 << 20, dtype=torch.uint8)}, path)  # 4 MiB, compresses in no time
    saved = tmp_path / "policy.json"
    assert _bench(path, "--save-policy", str(saved), "--sample-mb", "4") == 0
    assert "warning" not in capsys.readouterr().err and saved.exists()


def test_plot_tick_labels_do_not_overlap(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (in the test extra)")
    import matplotlib.pyplot as plt

    comps = _components()
    comps["exp_avg"]["candidates"].append(_candidate("zstd", 3, "none", 1.2, 0.13))
    fig = plot_figure(comps, storage_gbps=5.0)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        for axis, along in ((ax.xaxis, "x0"), (ax.yaxis, "y0")):
            labels = [t for t in axis.get_ticklabels(which="both") if t.get_visible() and t.get_text()]
            boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: getattr(b, along))
            assert len(boxes) >= 3
            for a, b in zip(boxes, boxes[1:]):
                assert not a.overlaps(b), [t.get_text() for t in labels]
        xlabel = ax.xaxis.label.get_window_extent(renderer)
        assert all(
            not xlabel.overlaps(t.get_window_extent(renderer)) for t in ax.xaxis.get_ticklabels(which="both") if t.get_text()
        )
        fig.savefig(tmp_path / "bench.png")
    finally:
        plt.close(fig)
