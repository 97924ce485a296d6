"""The benchmarks' results store: how a run is judged against its baseline, and compare.py's exit status."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(name: str) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # compare.py imports results_store by name
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


store = _module("results_store")
compare = _module("compare")


def _run(**metrics: tuple[float, str]) -> dict:
    return {
        "bench": "limits",
        "env": {"commit": "0" * 40, "loadavg": [1.0, 1.0, 1.0]},
        "metrics": {name: store.metric(v, "x", better) for name, (v, better) in metrics.items()},
    }


def _verdicts(run: dict, baseline: dict, tolerance: float = 0.1) -> dict[str, str]:
    return {f.name: f.verdict for f in store.compare_runs(run, baseline, tolerance)}


def test_an_exact_metric_regresses_on_any_loss_and_a_timed_one_only_beyond_the_tolerance() -> None:
    baseline = _run(ratio=(1.300, "exact"), load_mbps=(1000, "higher"), save_s=(1.0, "lower"))
    run = _run(ratio=(1.299, "exact"), load_mbps=(920, "higher"), save_s=(1.09, "lower"))
    assert _verdicts(run, baseline) == {"ratio": "regression", "load_mbps": "same", "save_s": "same"}
    run = _run(ratio=(1.300, "exact"), load_mbps=(880, "higher"), save_s=(1.2, "lower"))
    assert _verdicts(run, baseline) == {"ratio": "same", "load_mbps": "regression", "save_s": "regression"}
    run = _run(ratio=(1.31, "exact"), load_mbps=(1200, "higher"), save_s=(0.8, "lower"))
    assert _verdicts(run, baseline) == {"ratio": "improvement", "load_mbps": "improvement", "save_s": "improvement"}


def test_metrics_on_one_side_only_are_new_or_missing_and_benches_must_match() -> None:
    findings = store.compare_runs(_run(a=(1, "higher")), _run(b=(1, "higher")))
    assert [(f.name, f.verdict) for f in findings] == [("a", "new"), ("b", "missing")]
    other = dict(_run(), bench="async")
    with pytest.raises(ValueError, match="async"):
        store.compare_runs(_run(), other)
    with pytest.raises(ValueError, match="better"):
        store.metric(1.0, "s", "faster")


def test_compare_exits_1_on_a_regression_and_0_otherwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, good, bad = tmp_path / "base.json", tmp_path / "good.json", tmp_path / "bad.json"
    base.write_text(json.dumps(_run(ratio=(1.3, "exact"), mbps=(100, "higher"))))
    good.write_text(json.dumps(_run(ratio=(1.3, "exact"), mbps=(95, "higher"))))
    bad.write_text(json.dumps(_run(ratio=(1.3, "exact"), mbps=(50, "higher"))))
    assert compare.main([str(good), "--baseline", str(base)]) == 0
    assert compare.main([str(bad), "--baseline", str(base)]) == 1
    assert "REGRESSION" in capsys.readouterr().out
