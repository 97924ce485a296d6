"""The one table of benchmarks/gpu_check.sh: every step's outcome and time, the tests, the codec
and save measurements, printed and written to ``$OUT/gpu_check_table.md``.

Reads what the steps left in ``--out``: steps.tsv (name, exit code, seconds, limit), versions.json,
pytest.xml (JUnit), gpu_codec_bench.json, gpu_async_bench.json, and the ``gpu_fsdp_check:`` lines
of gpu_check.log; a missing file is a row that says so, never an error, so a check cut short still
reports what it did.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(out: Path) -> dict[str, tuple[int, float, int]]:
    steps: dict[str, tuple[int, float, int]] = {}
    try:
        lines = (out / "steps.tsv").read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        name, rc, seconds, limit = line.split("\t")
        steps[name] = (int(rc), float(seconds), int(limit))
    return steps


def _step_result(steps: dict[str, tuple[int, float, int]], name: str) -> str:
    if name not in steps:
        return "not run"
    rc, seconds, limit = steps[name]
    outcome = "ok" if rc == 0 else ("TIMED OUT" if rc in (124, 137) else f"exit {rc}")
    return f"{outcome}, {seconds:.0f} of {limit} s"


def _tests(out: Path) -> str:
    try:
        root = ET.parse(out / "pytest.xml").getroot()
    except (OSError, ET.ParseError):
        return "no JUnit report"
    suites = [root] if root.tag == "testsuite" else list(root)
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    names = [
        c.get("name", "?")
        for s in suites
        for c in s.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    text = f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped"
    return text + (f"; failed: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}" if names else "")


def _fsdp_rows(out: Path, prefix: str = "gpu_fsdp_check: ") -> list[dict[str, Any]]:
    rows = []
    try:
        lines = (out / "gpu_check.log").read_text(errors="replace").splitlines()
    except OSError:
        return rows
    for line in lines:
        if line.startswith(prefix):
            try:
                rows.append(json.loads(line[len(prefix) :]))
            except ValueError:
                continue
    return rows


def build(out: Path) -> str:
    steps = _steps(out)
    rows: list[tuple[str, str, str]] = []
    versions = _load(out / "versions.json") or {}
    rows.append(("environment", _step_result(steps, "versions"), versions.get("text", "no versions.json")))
    rows.append(("wheels from .whl/", _step_result(steps, "install"), versions.get("wheels", "")))
    rows.append(("GPU tests (-m gpu)", _step_result(steps, "tests"), _tests(out)))

    bench = _load(out / "gpu_codec_bench.json")
    rows.append(("codec benchmark", _step_result(steps, "codec_bench"), "" if bench else "no gpu_codec_bench.json"))
    for r in (bench or {}).get("summary", []):
        check = f", host check {r['host_check_gbps']:.1f} GB/s" if r.get("host_check_gbps") else ""
        rows.append(
            (
                f"  {r['device']} {r['codec']} {r['chunk_kib']} KiB chunks",
                "exact" if r["exact"] else "ROUND TRIP DIFFERS",
                f"ratio {r['ratio']:.3f}, compress {r['compress_gbps']:.2f} GB/s, decompress {r['decompress_gbps']:.2f} GB/s"
                f"{check}, {r['host_decoded']} frames to libzstd",
            )
        )
    if bench is not None:
        chosen = bench.get("gpu_zstd_chunk_kib")
        rows.append(
            (
                "  measured GPU zstd chunk",
                f"{chosen} KiB" if chosen else "none (no exact GPU zstd row)",
                "fastest with a ratio within 1% of the best: gpu_chunk_bytes in codecs/registry.py",
            )
        )
        if bench.get("skipped"):
            rows.append(("  not measured", f"{len(bench['skipped'])} runs", ", ".join(bench["skipped"][:6])))

    save = _load(out / "gpu_async_bench.json")
    rows.append(
        (
            "trained checkpoint saves",
            _step_result(steps, "save_bench"),
            f"{save['raw_bytes'] / 2**20:.0f} MiB on {save['device']}" if save else "no gpu_async_bench.json",
        )
    )
    for name, r in (save or {}).get("results", {}).items():
        rows.append(
            (
                f"  {name}",
                f"blocked {r['blocked_s']:.3f} s",
                f"durable {r['durable_s']:.3f} s, ratio {save['raw_bytes'] / r['bytes']:.3f}x",
            )
        )
    reloads = (save or {}).get("reloads", {})
    if reloads:
        bad = [k for k, ok in reloads.items() if not ok]
        rows.append(
            ("  reloads bit-identical", f"{len(reloads) - len(bad)} of {len(reloads)}", ", ".join(bad) or ", ".join(reloads))
        )
    fsdp = _fsdp_rows(out)
    rows.append(("framework wheels from .whl-fw/", _step_result(steps, "install_frameworks"), ""))
    rows.append(
        ("sharded checkpoints (FSDP)", _step_result(steps, "fsdp"), f"{len(fsdp)} cases reported" if fsdp else "no case reported")
    )
    for r in fsdp:
        outcome = {True: "ok", False: "FAILED", None: "not run"}[r.get("ok")]
        seconds = f", {r['seconds']:.0f} s" if r.get("seconds") else ""
        rows.append(
            (f"  {r.get('case')}", outcome + seconds, str(r.get("detail", "")).replace("|", "/").replace("\n", " ")[:400])
        )
    for r in _fsdp_rows(out, "gpu_deepspeed_check: "):
        detail = r.get("why") or f"losses {r.get('resumed')} vs {r.get('ref')}, {r.get('files')} files"
        rows.append((f"DeepSpeed: {r.get('case')}", f"{r.get('status')} ({_step_result(steps, 'deepspeed')})", str(detail)[:400]))
    total = sum(s for _, s, _ in steps.values())
    limits = sum(limit for _, _, limit in steps.values())
    rows.append(("all steps", f"{total:.0f} s", f"their limits add up to {limits} s, and 4 s for this table"))

    lines = ["| check | result | detail |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder the steps wrote to ($OUT)")
    args = parser.parse_args(argv)
    text = build(args.out)
    (args.out / "gpu_check_table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
