"""``nvckpt estimate``: what synchronous checkpoints cost a month, without and with compression.

The model (formulas in ``docs/cli.md``) reproduces the worked example of the nvCOMP checkpoint
article: 782 GB, 8 GPUs at $4.40/h, 5 GB/s, every 30 min -> 156.4 s per write, $2,203/month idle.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import nvcomp_checkpoint as nc
from nvcomp_checkpoint import boundedjson
from nvcomp_checkpoint.errors import CheckpointError

from ._ui import EXIT_OK, make_table, print_json, stdout_console
from .sources import DIRECTORY, NVCOMP, dir_files, sniff

__all__ = ["add_parser", "run_estimate", "EstimateInputs", "estimate", "ratio_from", "TierCost", "parse_tier", "tier_costs"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "estimate",
        parents=[common],
        help="monthly GPU-idle and storage cost of checkpointing, without and with compression",
        description=(
            "Per-checkpoint write time and monthly GPU-idle and storage cost of synchronous checkpoints, "
            "without and with compression, and the saving. Compression and the storage write are pipelined: "
            "a write takes max(size / codec speed, compressed size / storage speed). Sizes in decimal GB."
        ),
    )
    p.add_argument("--checkpoint-gb", type=float, required=True, help="raw size of one checkpoint, GB (1e9 bytes)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs that wait while a checkpoint is written")
    p.add_argument("--gpu-hour-usd", type=float, required=True, help="price of one GPU hour, USD")
    p.add_argument("--storage-gbps", type=float, required=True, help="storage write throughput, GB/s")
    p.add_argument("--interval-min", type=float, required=True, help="minutes between checkpoints")
    p.add_argument("--retain", type=int, required=True, help="checkpoints kept in storage")
    p.add_argument("--storage-usd-gb-month", type=float, required=True, help="storage price, USD per GB-month")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ratio", type=float, help="compression ratio (raw / stored), e.g. 1.27")
    src.add_argument(
        "--from",
        dest="from_path",
        metavar="PATH",
        help="take the ratio from a real checkpoint: one of our files or directories, a `compress --json` "
        "report, or a `bench --json` output (which also gives the codec speed)",
    )
    p.add_argument(
        "--codec-gbps",
        type=float,
        help="compression throughput, GB/s (default: from --from's bench, else assumed faster than the storage)",
    )
    p.add_argument("--days", type=float, default=30.0, help="days in a month (default 30, as the article)")
    p.add_argument(
        "--tier",
        dest="tiers",
        action="append",
        default=[],
        type=parse_tier,
        metavar="NAME:EVERY_MIN:KEEP:USD_GB_MONTH",
        help="a storage tier (repeatable), e.g. local:5:2:0 shared:30:4:0.30 object:60:24:0.023: adds the storage "
        "kept and its cost per tier, without and with compression (EVERY_MIN 0: every checkpoint)",
    )
    p.add_argument("--json", action="store_true", help="print every figure as JSON")
    p.set_defaults(func=run_estimate)


@dataclass(frozen=True)
class TierCost:
    """One storage tier of an estimate: its copy interval, copies kept and price."""

    name: str
    every_min: float
    keep: int
    usd_gb_month: float


def parse_tier(text: str) -> TierCost:
    """``NAME:EVERY_MIN:KEEP:USD_GB_MONTH`` -> :class:`TierCost` (argparse reports a ValueError as a usage error)."""
    parts = text.split(":")
    if len(parts) != 4 or not parts[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:EVERY_MIN:KEEP:USD_GB_MONTH, e.g. object:60:24:0.023")
    try:
        every, keep, price = float(parts[1]), int(parts[2]), float(parts[3])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: EVERY_MIN and USD_GB_MONTH must be numbers and KEEP an integer") from None
    if not (every >= 0 and math.isfinite(every)) or keep < 1 or not (price >= 0 and math.isfinite(price)):
        raise argparse.ArgumentTypeError(f"{text!r}: EVERY_MIN and USD_GB_MONTH must be zero or more and KEEP at least 1")
    return TierCost(parts[0], every, keep, price)


def tier_costs(inp: EstimateInputs, tiers: list[TierCost]) -> list[dict[str, Any]]:
    """Storage kept and its monthly cost per tier: copies kept x checkpoint size x price (docs/tiers.md)."""
    per_month = 60.0 / inp.interval_min * 24.0 * inp.days
    stored = inp.checkpoint_gb / inp.ratio
    out = []
    for t in tiers:
        # A tier cannot receive copies more often than checkpoints are made.
        interval = max(t.every_min, inp.interval_min)
        copies = per_month if t.every_min == 0 else 60.0 / interval * 24.0 * inp.days
        without_gb, with_gb = t.keep * inp.checkpoint_gb, t.keep * stored
        out.append(
            {
                "name": t.name,
                "every_min": interval,
                "keep": t.keep,
                "usd_gb_month": t.usd_gb_month,
                "copies_month": copies,
                "moved_gb_month_without": copies * inp.checkpoint_gb,
                "moved_gb_month_with": copies * stored,
                "stored_gb_without": without_gb,
                "stored_gb_with": with_gb,
                "usd_month_without": without_gb * t.usd_gb_month,
                "usd_month_with": with_gb * t.usd_gb_month,
            }
        )
    return out


@dataclass(frozen=True)
class EstimateInputs:
    """The figures an estimate is computed from (sizes in GB, speeds in GB/s, prices in USD)."""

    checkpoint_gb: float
    gpus: int
    gpu_hour_usd: float
    storage_gbps: float
    interval_min: float
    retain: int
    storage_usd_gb_month: float
    ratio: float
    codec_gbps: float | None = None
    days: float = 30.0

    def check(self) -> None:
        """Raises CheckpointError naming the option that makes no sense."""
        positive = {
            "--checkpoint-gb": self.checkpoint_gb,
            "--gpus": self.gpus,
            "--storage-gbps": self.storage_gbps,
            "--interval-min": self.interval_min,
            "--ratio": self.ratio,
            "--days": self.days,
        }
        if self.codec_gbps is not None:
            positive["--codec-gbps"] = self.codec_gbps
        for name, value in positive.items():
            if not (value > 0 and math.isfinite(value)):
                raise CheckpointError(f"{name} must be a positive number, got {value}")
        for name, value in {
            "--gpu-hour-usd": self.gpu_hour_usd,
            "--retain": self.retain,
            "--storage-usd-gb-month": self.storage_usd_gb_month,
        }.items():
            if not (value >= 0 and math.isfinite(value)):
                raise CheckpointError(f"{name} must be zero or more, got {value}")


def _side(inp: EstimateInputs, size_gb: float, write_s: float, per_month: float) -> dict[str, float]:
    idle_hours = write_s * per_month / 3600
    storage_gb = inp.retain * size_gb
    idle_usd = idle_hours * inp.gpus * inp.gpu_hour_usd
    storage_usd = storage_gb * inp.storage_usd_gb_month
    return {
        "checkpoint_gb": size_gb,
        "write_s": write_s,
        "idle_hours_month": idle_hours,
        "idle_gpu_hours_month": idle_hours * inp.gpus,
        "idle_usd_month": idle_usd,
        "stored_gb": storage_gb,
        "storage_usd_month": storage_usd,
        "total_usd_month": idle_usd + storage_usd,
    }


def estimate(inp: EstimateInputs) -> dict[str, Any]:
    """Every figure of the estimate (see ``docs/cli.md`` for the formulas)."""
    inp.check()
    per_month = 60.0 / inp.interval_min * 24.0 * inp.days
    raw_write = inp.checkpoint_gb / inp.storage_gbps
    stored = inp.checkpoint_gb / inp.ratio
    storage_write = stored / inp.storage_gbps
    compress_s = inp.checkpoint_gb / inp.codec_gbps if inp.codec_gbps else 0.0
    # Chunks are compressed while earlier chunks are written: the slower stage sets the pace.
    with_write = max(compress_s, storage_write)
    without = _side(inp, inp.checkpoint_gb, raw_write, per_month)
    with_ = _side(inp, stored, with_write, per_month)
    with_.update(compress_s=compress_s, storage_write_s=storage_write)
    saving = {k: without[k] - with_[k] for k in without}
    saving["write_percent"] = 100.0 * saving["write_s"] / raw_write
    saving["size_percent"] = 100.0 * (1 - 1 / inp.ratio)
    return {
        "inputs": asdict(inp),
        "checkpoints_per_month": per_month,
        "written_gb_month": inp.checkpoint_gb * per_month,
        "compression_hidden": compress_s <= storage_write,
        "without": without,
        "with": with_,
        "saving": saving,
    }


def _round(d: Any) -> Any:
    if isinstance(d, float):
        return round(d, 4)
    if isinstance(d, dict):
        return {k: _round(v) for k, v in d.items()}
    return d


def ratio_from(path: str, storage_gbps: float) -> dict[str, Any]:
    """``{ratio, codec_gbps|None, source}`` measured on a real checkpoint, report or bench output.

    Raises:
        CheckpointError: the path holds no measured ratio.
    """
    kind = sniff(path)
    if kind == NVCOMP:
        with nc.open(path) as reader:
            return {
                "ratio": reader.raw_bytes / reader.file_bytes,
                "codec_gbps": None,
                "source": f"{path} (nvcomp-checkpoint file)",
            }
    if kind == DIRECTORY:
        raw = stored = 0
        found = False
        for rel, k in dir_files(path):
            full = os.path.join(path, rel)
            size = os.path.getsize(full)
            stored += size
            if k == NVCOMP:
                found = True
                with nc.open(full) as reader:
                    raw += reader.raw_bytes
            else:
                raw += size
        if not found:
            raise CheckpointError(f"{path}: holds no nvcomp-checkpoint files; compress it first or pass a `bench --json` output")
        return {"ratio": raw / stored, "codec_gbps": None, "source": f"{path} (directory)"}
    try:
        with open(path, encoding="utf-8") as f:
            doc = boundedjson.loads(f.read(), path, "bench output")
    except (UnicodeDecodeError, json.JSONDecodeError, OSError):
        doc = None
    if isinstance(doc, dict) and doc.get("nvckpt") == "bench":
        from .bench import recommend

        rec = recommend(doc["components"], storage_gbps)
        return {
            "ratio": rec["ratio"],
            "codec_gbps": rec["compress_gbps"],
            "source": f"{path} (bench, re-picked for {storage_gbps:g} GB/s)",
            "policy": rec["choices"],
        }
    if (
        isinstance(doc, dict)
        and isinstance(doc.get("raw_bytes"), int)
        and isinstance(doc.get("stored_bytes"), int)
        and doc["stored_bytes"]
    ):
        return {"ratio": doc["raw_bytes"] / doc["stored_bytes"], "codec_gbps": None, "source": f"{path} (save report)"}
    raise CheckpointError(
        f"{path}: holds no measured compression ratio; pass one of our checkpoints (nvckpt compress makes one), "
        "a `compress --json` report or a `bench --json` output"
    )


def _money(x: float) -> str:
    return f"-${-x:,.0f}" if x < 0 else f"${x:,.0f}"


def run_estimate(args: argparse.Namespace) -> int:
    ratio, codec, source = args.ratio, args.codec_gbps, "--ratio"
    measured: dict[str, Any] = {}
    if args.from_path:
        measured = ratio_from(args.from_path, args.storage_gbps)
        ratio, source = measured["ratio"], measured["source"]
        if codec is None:
            codec = measured["codec_gbps"]
    inp = EstimateInputs(
        args.checkpoint_gb,
        args.gpus,
        args.gpu_hour_usd,
        args.storage_gbps,
        args.interval_min,
        args.retain,
        args.storage_usd_gb_month,
        ratio,
        codec,
        args.days,
    )
    result = estimate(inp)
    result["ratio_source"] = source
    if args.tiers:
        result["tiers"] = tier_costs(inp, args.tiers)
        # The first table's total (GPU idle, tier-0 storage) plus every tier's storage.
        all_in = {
            k: result[k]["total_usd_month"] + sum(t[f"usd_month_{k}"] for t in result["tiers"]) for k in ("without", "with")
        }
        result["all_in_usd_month"] = dict(all_in, saving=all_in["without"] - all_in["with"])
    if "policy" in measured:
        result["policy_choices"] = measured["policy"]
    if args.json:
        print_json(_round(result))
        return EXIT_OK
    w, c, s = result["without"], result["with"], result["saving"]
    rows = [
        [
            "checkpoint size",
            f"{w['checkpoint_gb']:,.1f} GB",
            f"{c['checkpoint_gb']:,.1f} GB",
            f"{s['checkpoint_gb']:,.1f} GB ({s['size_percent']:.0f}%)",
        ],
        [
            "write per checkpoint",
            f"{w['write_s']:,.1f} s",
            f"{c['write_s']:,.1f} s",
            f"{s['write_s']:,.1f} s ({s['write_percent']:.0f}%)",
        ],
        [
            "GPU idle per month",
            f"{w['idle_hours_month']:,.1f} h",
            f"{c['idle_hours_month']:,.1f} h",
            f"{s['idle_hours_month']:,.1f} h",
        ],
        ["GPU idle cost per month", _money(w["idle_usd_month"]), _money(c["idle_usd_month"]), _money(s["idle_usd_month"])],
        [f"storage ({inp.retain} kept)", f"{w['stored_gb']:,.0f} GB", f"{c['stored_gb']:,.0f} GB", f"{s['stored_gb']:,.0f} GB"],
        [
            "storage cost per month",
            _money(w["storage_usd_month"]),
            _money(c["storage_usd_month"]),
            _money(s["storage_usd_month"]),
        ],
        [
            "total per month" + (" (GPU idle + tier 0)" if args.tiers else ""),
            _money(w["total_usd_month"]),
            _money(c["total_usd_month"]),
            _money(s["total_usd_month"]),
        ],
    ]
    console = stdout_console()
    title = (
        f"{inp.checkpoint_gb:g} GB every {inp.interval_min:g} min ({result['checkpoints_per_month']:,.0f}/month, "
        f"{result['written_gb_month'] / 1e6:.2f} PB written), {inp.gpus} GPUs at ${inp.gpu_hour_usd:.2f}/h, "
        f"{inp.storage_gbps:g} GB/s storage"
    )
    console.print(make_table(title, ["", "without", f"with ({inp.ratio:.3g}x)", "saving"], rows))
    notes = [f"ratio from {source}"]
    if codec is None:
        notes.append("codec speed not given: compression assumed faster than the storage (--codec-gbps to set it)")
    elif result["compression_hidden"]:
        notes.append(
            f"compression at {codec:g} GB/s ({c['compress_s']:,.1f} s) is hidden behind the {c['storage_write_s']:,.1f} s storage write"
        )
    else:
        notes.append(
            f"compression at {codec:g} GB/s ({c['compress_s']:,.1f} s) is slower than writing the compressed bytes "
            f"({c['storage_write_s']:,.1f} s): it sets the write time; a faster codec (or none) is better here"
        )
    if args.tiers:
        trows = [
            [
                t["name"],
                f"{t['every_min']:g} min",
                str(t["keep"]),
                f"{t['moved_gb_month_with']:,.0f} GB",
                f"{t['stored_gb_without']:,.0f} GB",
                f"{t['stored_gb_with']:,.0f} GB",
                _money(t["usd_month_without"]),
                _money(t["usd_month_with"]),
                _money(t["usd_month_without"] - t["usd_month_with"]),
            ]
            for t in result["tiers"]
        ]
        total = [sum(t[k] for t in result["tiers"]) for k in ("usd_month_without", "usd_month_with")]
        trows.append(["total (tiers)", "", "", "", "", "", _money(total[0]), _money(total[1]), _money(total[0] - total[1])])
        console.print(
            make_table(
                "storage per tier (copies kept x checkpoint size x price)",
                [
                    "tier",
                    "every",
                    "kept",
                    "moved/month (with)",
                    "stored without",
                    "stored with",
                    "cost without",
                    "cost with",
                    "saving",
                ],
                trows,
            )
        )
        a = result["all_in_usd_month"]
        console.print(
            f"all in, per month (GPU idle + tier 0 + the tiers): {_money(a['without'])} without, {_money(a['with'])} with "
            f"compression, {_money(a['saving'])} saved",
            markup=False,
            highlight=False,
        )
    for n in notes:
        console.print(n, markup=False, highlight=False)
    return EXIT_OK
