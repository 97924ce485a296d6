"""Compare a benchmark run with its stored baseline and flag regressions.

    python benchmarks/compare.py                        # the newest run of every benchmark with a baseline
    python benchmarks/compare.py benchmarks/out/results/limits-20261205T013000Z.json
    python benchmarks/compare.py RUN.json --baseline OTHER.json --tolerance 0.25

Exit status 1 when any metric regressed (``results_store.compare_runs`` says what counts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_store import BASELINE_DIR, DEFAULT_TOLERANCE, RUNS_DIR, compare_runs  # noqa: E402


def _latest_runs() -> list[Path]:
    runs = []
    for base in sorted(BASELINE_DIR.glob("*.json")):
        candidates = sorted(RUNS_DIR.glob(f"{base.stem}-*.json"))
        if candidates:
            runs.append(candidates[-1])
    return runs


def _load(label: str, path: Path) -> str:
    la = json.loads(path.read_text())["env"].get("loadavg")
    return f"{label} {path.name}: load {la[0]:.2f}" if la else f"{label} {path.name}"


def report(run_path: Path, baseline_path: Path, tolerance: float) -> int:
    """Print the comparison of one run; returns the number of regressions."""
    run, baseline = json.loads(run_path.read_text()), json.loads(baseline_path.read_text())
    findings = compare_runs(run, baseline, tolerance)
    print(
        f"== {run['bench']}: {_load('run', run_path)} ({run['env']['commit'][:10]}) vs {_load('baseline', baseline_path)} "
        f"({baseline['env']['commit'][:10]}), tolerance {tolerance:.0%}"
    )
    width = max((len(f.name) for f in findings), default=10)
    for f in findings:
        base = "-" if f.baseline is None else f"{f.baseline:.4g}"
        value = "-" if f.value is None else f"{f.value:.4g}"
        ratio = "" if f.ratio is None else f"x{f.ratio:.3f}"
        flag = "  <-- REGRESSION" if f.verdict == "regression" else ""
        print(f"  {f.name:<{width}}  {base:>10} -> {value:>10} {f.unit:<6} {ratio:>8}  {f.verdict}{flag}")
    return sum(f.verdict == "regression" for f in findings)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", type=Path, help="run files (default: the newest run of each benchmark)")
    p.add_argument("--baseline", type=Path, help="baseline file (default: benchmarks/results/<bench>.json)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="share a time may be worse (default %(default)s)")
    args = p.parse_args(argv)
    runs = args.runs or _latest_runs()
    if not runs:
        print(f"no runs to compare: run a benchmark first (runs go to {RUNS_DIR})", file=sys.stderr)
        return 2
    regressions = 0
    for run_path in runs:
        bench = json.loads(run_path.read_text())["bench"]
        baseline = args.baseline or BASELINE_DIR / f"{bench}.json"
        if not baseline.exists():
            print(f"{run_path}: no baseline at {baseline} (run the benchmark with --store to make one)", file=sys.stderr)
            return 2
        regressions += report(run_path, baseline, args.tolerance)
    print(f"{regressions} regression(s)")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
