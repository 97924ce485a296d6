"""Prometheus metrics of checkpoint saves and tier copies, in ``prometheus_client``'s default registry.

``prometheus_client`` is optional (the ``metrics`` extra, see ``version.install_hint``): without it every
``record_*`` call does nothing and :func:`serve_metrics` says what to install.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import CheckpointError
from .version import install_hint

__all__ = [
    "serve_metrics",
    "metrics_available",
    "record_bytes_written",
    "record_save_seconds",
    "record_blocked_seconds",
    "record_last_step",
    "record_ratio",
    "record_copy_skipped",
]

_LOCK = threading.Lock()
_METRICS: dict[str, Any] | None = None
_MISSING = False


def metrics_available() -> bool:
    """True when ``prometheus_client`` is installed (metrics are then recorded)."""
    return _metrics() is not None


def _metrics() -> dict[str, Any] | None:
    # Created once per process: registering a name twice in the default registry raises.
    global _METRICS, _MISSING
    if _METRICS is not None or _MISSING:
        return _METRICS
    with _LOCK:
        if _METRICS is not None or _MISSING:
            return _METRICS
        try:
            import prometheus_client as pc
        except ImportError:
            _MISSING = True
            return None
        _METRICS = {
            "bytes": pc.Counter("nvckpt_bytes_written", "Checkpoint bytes written, per tier (compressed, as stored)", ["tier"]),
            "seconds": pc.Histogram(
                "nvckpt_save_seconds",
                "Seconds per save phase and tier (snapshot, write, copy, verify)",
                ["tier", "phase"],
                buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
            ),
            "blocked": pc.Counter("nvckpt_training_blocked_seconds", "Seconds training waited for checkpoint saves"),
            "last_step": pc.Gauge("nvckpt_last_step", "Newest step with a complete copy, per tier", ["tier"]),
            "ratio": pc.Gauge("nvckpt_ratio", "Compression ratio (raw / stored bytes) of the latest save"),
            "skipped": pc.Counter("nvckpt_copies_skipped", "Due copies skipped because the tier was behind", ["tier"]),
        }
        return _METRICS


def record_bytes_written(tier: str, nbytes: int) -> None:
    if (m := _metrics()) is not None:
        m["bytes"].labels(tier=tier).inc(nbytes)


def record_save_seconds(tier: str, phase: str, seconds: float) -> None:
    if (m := _metrics()) is not None:
        m["seconds"].labels(tier=tier, phase=phase).observe(seconds)


def record_blocked_seconds(seconds: float) -> None:
    if (m := _metrics()) is not None:
        m["blocked"].inc(seconds)


def record_last_step(tier: str, step: int) -> None:
    if (m := _metrics()) is not None:
        m["last_step"].labels(tier=tier).set(step)


def record_ratio(ratio: float) -> None:
    if (m := _metrics()) is not None:
        m["ratio"].set(ratio)


def record_copy_skipped(tier: str) -> None:
    if (m := _metrics()) is not None:
        m["skipped"].labels(tier=tier).inc()


#: Where :func:`serve_metrics` listens by default: this machine only. The metrics name tiers, steps and
#: sizes; a Prometheus on another host is reached by ``addr="0.0.0.0"`` (every interface) or one
#: interface's address, chosen by the caller, never by default.
DEFAULT_METRICS_ADDR = "127.0.0.1"


def serve_metrics(port: int, addr: str = DEFAULT_METRICS_ADDR) -> Any:
    """Serve the default registry at ``http://addr:port/metrics`` from a daemon thread.

    Args:
        port: TCP port (0: one the kernel picks; ``server.server_port`` says which).
        addr: The address to listen on: by default ``127.0.0.1``, this machine only; ``"0.0.0.0"``
            for every interface (a scraper on another host), or one interface's address.

    Returns:
        ``prometheus_client``'s ``(server, thread)``; ``server.shutdown()`` stops it.

    Raises:
        CheckpointError: ``prometheus_client`` is not installed.
    """
    if _metrics() is None:
        raise CheckpointError(f"metrics need prometheus_client: pip install prometheus_client, or {install_hint('metrics')}")
    import prometheus_client as pc

    return pc.start_http_server(port, addr=addr)
