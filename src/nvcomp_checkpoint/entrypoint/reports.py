"""The report of one committed checkpoint, and its numbers as a framework logger's metrics."""

from __future__ import annotations

import logging
import os
from typing import Iterable

from ..report import SaveReport, merge_reports

__all__ = ["checkpoint_report", "report_metrics"]

_LOG = logging.getLogger("nvcomp_checkpoint")


def checkpoint_report(
    path: str | os.PathLike[str],
    seconds: float,
    *,
    reports: Iterable[SaveReport] = (),
    dcp_dirs: Iterable[str | os.PathLike[str]] = (),
    seconds_blocked: float | None = None,
) -> SaveReport | None:
    """The report of one committed checkpoint: ``reports`` in hand, merged with the report of each
    committed DCP directory in ``dcp_dirs`` (:func:`~nvcomp_checkpoint.dcp.dcp_report`: every rank
    file's index), as one save of ``seconds``.

    A report never fails a committed save, nor keeps a rank from the collective that follows: if
    one cannot be built (a rank file unreadable on a shared file system), a warning names the
    checkpoint and the cause, and the report covers ``reports`` alone (``None`` without them).
    """
    given = list(reports)
    parts = list(given)
    try:
        if dcp_dirs:
            from ..dcp import dcp_report  # torch.distributed.checkpoint: only for the integrations that write DCP

            parts += [dcp_report(os.fspath(d)) for d in dcp_dirs]
        return merge_reports(os.fspath(path), parts, seconds, seconds_blocked) if parts else None
    except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; only its numbers are missing
        _LOG.warning(
            "%s: committed, but its save report could not be built (%s: %s); %s",
            os.fspath(path),
            type(exc).__name__,
            exc,
            "the report covers the other files only" if given else "no report for this save",
        )
        return merge_reports(os.fspath(path), given, seconds, seconds_blocked) if given else None


def report_metrics(report: SaveReport, prefix: str = "nvckpt/") -> dict[str, float]:
    """The numbers of one save as flat metrics (for a framework's loggers).

    Returns:
        ``{prefix}ratio``, ``raw_bytes``, ``stored_bytes``, ``seconds`` (until durable),
        ``seconds_blocked`` (time the training loop waited), ``throughput_mb_s`` (raw MB per
        second of ``seconds``) and ``ratio/<component>`` for each component (``weights``,
        ``exp_avg`` ...).
    """
    blocked = report.seconds if report.seconds_blocked is None else report.seconds_blocked
    metrics = {
        f"{prefix}ratio": report.ratio,
        f"{prefix}raw_bytes": float(report.raw_bytes),
        f"{prefix}stored_bytes": float(report.stored_bytes),
        f"{prefix}seconds": report.seconds,
        f"{prefix}seconds_blocked": blocked,
        f"{prefix}throughput_mb_s": report.throughput_mb_s,
    }
    for name, stats in report.components.items():
        metrics[f"{prefix}ratio/{name}"] = stats.ratio
    # A save too fast for the clock has an infinite throughput, which loggers reject.
    return {k: float(v) for k, v in metrics.items() if v == v and abs(v) != float("inf")}
