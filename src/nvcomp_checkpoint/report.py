"""What a save wrote, what a file holds: per-component sizes, ratios and codecs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = [
    "ComponentStats",
    "ComponentSummary",
    "SaveReport",
    "merge_reports",
    "format_bytes",
    "format_table",
    "component_rows",
    "component_table",
    "codec_notes",
    "overhead_note",
    "COMPONENT_COLUMNS",
]

#: The columns of every per-component table (``SaveReport.table()``, ``summary()``, ``nvckpt``).
COMPONENT_COLUMNS = ["component", "tensors", "raw", "stored", "ratio", "codec", "filter"]

#: What a codec column entry means when it is not obvious from its name.
_CODEC_NOTES = {
    "none": "none = stored raw: tensors under 2 KiB (not worth a frame) or where the policy says none",
}


@dataclass(frozen=True)
class ComponentStats:
    """Totals for one component (``weights``, ``exp_avg`` ...).

    ``codecs`` names each codec with its level (``zstd:3``), as ``nvckpt inspect`` does;
    ``none`` is tensors stored raw.
    """

    tensors: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    codecs: tuple[str, ...] = ()
    filters: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def add(self, raw: int, stored: int, codec: str, filt: str) -> "ComponentStats":
        return ComponentStats(
            self.tensors + 1,
            self.raw_bytes + raw,
            self.stored_bytes + stored,
            tuple(sorted(set(self.codecs) | {codec})),
            tuple(sorted(set(self.filters) | {filt})),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.ratio, 4),
            "codecs": list(self.codecs),
            "filters": list(self.filters),
        }


@dataclass(frozen=True)
class SaveReport:
    """The result of a save.

    Attributes:
        path: Where the checkpoint was written.
        raw_bytes: Bytes of all tensors, uncompressed.
        stored_bytes: Size of the file written.
        seconds: Wall time of the whole save, fsync and rename included.
        seconds_blocked: Time the caller was blocked (equal to ``seconds`` for a sync save).
        components: Per-component totals.
        base: For a delta (``save(..., base=...)``): the base checkpoint it was written against,
            as passed; None for a full checkpoint.
    """

    path: str
    raw_bytes: int
    stored_bytes: int
    seconds: float
    components: Mapping[str, ComponentStats] = field(default_factory=dict)
    seconds_blocked: float | None = None
    base: str | None = None

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def throughput_mb_s(self) -> float:
        return self.raw_bytes / self.seconds / 1e6 if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.ratio, 4),
            "seconds": round(self.seconds, 4),
            "seconds_blocked": round(self.seconds if self.seconds_blocked is None else self.seconds_blocked, 4),
            "throughput_mb_s": round(self.throughput_mb_s, 1),
            "components": {k: v.to_dict() for k, v in self.components.items()},
            "base": self.base,
        }

    def table(self) -> str:
        """A plain-text per-component table, as printed by the examples and ``nvckpt``."""
        return component_table(self.components, self.raw_bytes, self.stored_bytes)

    def __str__(self) -> str:
        delta = f" (delta of {self.base})" if self.base is not None else ""
        return (
            f"{self.path}{delta}: {format_bytes(self.raw_bytes)} -> {format_bytes(self.stored_bytes)} "
            f"({self.ratio:.3f}x) in {self.seconds:.2f} s"
        )


def merge_reports(path: str, reports: Iterable[SaveReport], seconds: float, seconds_blocked: float | None = None) -> SaveReport:
    """One report for several files saved as one checkpoint (a directory's model and optimizer)."""
    components: dict[str, ComponentStats] = {}
    raw = stored = 0
    for report in reports:
        raw += report.raw_bytes
        stored += report.stored_bytes
        for name, s in report.components.items():
            c = components.get(name, ComponentStats())
            components[name] = ComponentStats(
                c.tensors + s.tensors,
                c.raw_bytes + s.raw_bytes,
                c.stored_bytes + s.stored_bytes,
                tuple(sorted(set(c.codecs) | set(s.codecs))),
                tuple(sorted(set(c.filters) | set(s.filters))),
            )
    return SaveReport(path, raw, stored, seconds, components, seconds if seconds_blocked is None else seconds_blocked)


class ComponentSummary(dict):
    """Per-component totals of a file (``reader.summary()``): a dict that prints as a table.

    Attributes:
        raw_bytes: Bytes of all tensors, uncompressed.
        stored_bytes: Size of the file.
    """

    def __init__(self, components: Mapping[str, ComponentStats], raw_bytes: int, stored_bytes: int) -> None:
        super().__init__(components)
        self.raw_bytes = raw_bytes
        self.stored_bytes = stored_bytes

    def table(self) -> str:
        return component_table(self, self.raw_bytes, self.stored_bytes)

    __str__ = table

    def __repr__(self) -> str:
        return self.table()


def codec_notes(components: Mapping[str, ComponentStats]) -> list[str]:
    """One line for each codec in the table whose meaning is not its name (``none``)."""
    used = {codec.split(":")[0] for stats in components.values() for codec in stats.codecs}
    return [note for codec, note in _CODEC_NOTES.items() if codec in used]


def overhead_note(components: Mapping[str, ComponentStats], raw_total: int, file_bytes: int) -> str | None:
    """A line when the file's index and headers outweigh what compression saved (a tiny model), else None."""
    frames = sum(s.stored_bytes for s in components.values())
    overhead = file_bytes - frames
    if file_bytes <= raw_total or overhead <= 0:
        return None
    return (
        f"note: the index and headers ({format_bytes(overhead)}) outweigh what compression saved "
        f"({format_bytes(max(0, raw_total - frames))}), so the file is larger than its raw tensors; "
        "this happens with tiny models only"
    )


def component_table(components: Mapping[str, ComponentStats], raw_total: int, stored_total: int) -> str:
    """The per-component table with its notes, as plain text."""
    lines = [format_table(COMPONENT_COLUMNS, component_rows(components, raw_total, stored_total))]
    lines.extend(codec_notes(components))
    note = overhead_note(components, raw_total, stored_total)
    if note:
        lines.append(note)
    return "\n".join(lines)


def component_rows(
    components: Mapping[str, ComponentStats], raw_total: int, stored_total: int, total_label: str = "total (file)"
) -> list[list[str]]:
    """One row per component, then the total: ``total_label`` says what ``stored_total`` counts
    (a whole file, or only the tensors' frames of several files, as in a DCP directory)."""
    rows = []
    for name, stats in components.items():
        rows.append(
            [
                name,
                str(stats.tensors),
                format_bytes(stats.raw_bytes),
                format_bytes(stats.stored_bytes),
                f"{stats.ratio:.3f}x",
                ",".join(stats.codecs),
                ",".join(stats.filters),
            ]
        )
    total = sum(s.tensors for s in components.values())
    ratio = raw_total / stored_total if stored_total else 1.0
    rows.append([total_label, str(total), format_bytes(raw_total), format_bytes(stored_total), f"{ratio:.3f}x", "", ""])
    return rows


def format_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def format_table(header: list[str], rows: Iterable[list[str]]) -> str:
    """A fixed-width text table (no dependency, so logs and examples print the same)."""
    rows = [list(map(str, r)) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(c.rjust(w) if i and c[:1].isdigit() else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        )
    return "\n".join(lines)
