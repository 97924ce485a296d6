"""Benchmark results that remember: each run is stored with its commit, machine and load, and
compared metric by metric with a stored baseline.

A run is one JSON file: ``{"bench", "env", "metrics"}``, each metric
``{"value", "unit", "better": "higher" | "lower" | "exact"}``. Baselines are committed under
``benchmarks/results/<bench>.json``; runs go to ``benchmarks/out/results/`` (not committed) unless
``--store`` asks a benchmark to make its run the new baseline. ``exact`` metrics (compression
ratios, bit-exact trial counts) do not depend on the machine: any loss is a regression. Times do,
so they are flagged only beyond a tolerance, and the load average of both runs is printed next to
them: a regression measured under a load the baseline did not have is a hint, not a verdict.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BASELINE_DIR", "RUNS_DIR", "metric", "environment", "write_run", "Finding", "compare_runs"]

HERE = Path(__file__).resolve().parent
#: Committed baselines, one file per benchmark.
BASELINE_DIR = HERE / "results"
#: Every run, not committed (benchmarks/out/ is ignored).
RUNS_DIR = HERE / "out" / "results"
#: Default share by which a time or throughput may be worse than the baseline before it is flagged:
#: runs on a shared machine differ by this much with nothing changed.
DEFAULT_TOLERANCE = 0.15


def metric(value: float, unit: str, better: str) -> dict[str, Any]:
    """One stored number; ``better``: ``"higher"``, ``"lower"`` or ``"exact"`` (higher, no tolerance)."""
    if better not in ("higher", "lower", "exact"):
        raise ValueError(f"better must be 'higher', 'lower' or 'exact', not {better!r}")
    return {"value": float(value), "unit": unit, "better": better}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict[str, Any]:
    """The commit, the machine and its load now."""
    import numpy
    import torch
    import zstandard

    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": {
            "host": platform.node(),
            "cpu": _cpu_model(),
            "cores": cores,
            "memory_gib": round(mem / 2**30, 1),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": numpy.__version__,
            "zstandard": zstandard.__version__,
            "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        },
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def write_run(bench: str, metrics: dict[str, dict[str, Any]], env: dict[str, Any], store: bool = False) -> Path:
    """Write one run to :data:`RUNS_DIR` (and as the baseline when ``store``); returns the run's path."""
    env = dict(env)
    if hasattr(os, "getloadavg"):
        env["loadavg_end"] = list(os.getloadavg())
    run = {"bench": bench, "env": env, "metrics": metrics}
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = env["date"].replace(":", "").replace("-", "").replace("+0000", "Z")
    path = RUNS_DIR / f"{bench}-{stamp}.json"
    path.write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    if store:
        BASELINE_DIR.mkdir(parents=True, exist_ok=True)
        (BASELINE_DIR / f"{bench}.json").write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return path


@dataclass(frozen=True)
class Finding:
    """One metric of a run next to the baseline's."""

    name: str
    unit: str
    better: str
    baseline: float | None
    value: float | None
    #: value / baseline (None when either is missing or the baseline is 0).
    ratio: float | None
    #: "regression", "improvement", "same", "new" (not in the baseline) or "missing" (not in the run).
    verdict: str


def compare_runs(run: dict[str, Any], baseline: dict[str, Any], tolerance: float = DEFAULT_TOLERANCE) -> list[Finding]:
    """Every metric of ``run`` and ``baseline``, judged.

    ``higher`` and ``lower`` metrics are a regression when worse than the baseline by more than
    ``tolerance`` (a share), ``exact`` ones when lower at all (beyond float rounding).
    """
    if run.get("bench") != baseline.get("bench"):
        raise ValueError(f"comparing benchmark {run.get('bench')!r} with a baseline of {baseline.get('bench')!r}")
    ours, theirs = run["metrics"], baseline["metrics"]
    findings = []
    for name in sorted(set(ours) | set(theirs)):
        m = ours.get(name) or theirs[name]
        better = m["better"]
        value = ours[name]["value"] if name in ours else None
        base = theirs[name]["value"] if name in theirs else None
        if value is None or base is None:
            findings.append(Finding(name, m["unit"], better, base, value, None, "missing" if value is None else "new"))
            continue
        ratio = value / base if base else None
        if better == "exact":
            slack = 1e-9 * max(1.0, abs(base))
            verdict = "regression" if value < base - slack else "improvement" if value > base + slack else "same"
        else:
            gain = (value - base) if better == "higher" else (base - value)
            scale = abs(base) if base else 1.0
            verdict = "regression" if gain < -tolerance * scale else "improvement" if gain > tolerance * scale else "same"
        findings.append(Finding(name, m["unit"], better, base, value, ratio, verdict))
    return findings
