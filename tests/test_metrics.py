"""Prometheus metrics of tiered saves, scraped over HTTP from the server ``nc.serve_metrics`` starts."""

from __future__ import annotations

import urllib.request

import pytest
import torch

import nvcomp_checkpoint as nc

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_served_and_counted(tmp_path):
    server, thread = nc.serve_metrics(0, addr="127.0.0.1")  # port 0: the kernel picks a free one, bound at once
    port = server.server_port
    try:
        before = _scrape(port)
        tiers = [nc.Tier(tmp_path / "a", name="m-local"), nc.Tier(tmp_path / "b", name="m-shared", every_steps=2)]
        g = torch.Generator().manual_seed(0)
        with nc.CheckpointManager(tiers) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, {"w": torch.randn(10_000, generator=g), "zeros": torch.zeros(50_000)})
                mgr.wait()
        after = _scrape(port)
    finally:
        server.shutdown()
    stored = {step: (tmp_path / "a" / f"step-{step:010d}.nvc").stat().st_size for step in (1, 2, 3)}

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # Bytes per tier are the stored (compressed) bytes of what landed there: 1, 2, 3 locally; 2 (a multiple
    # of every_steps) and 3 (the newest, copied at close) shared.
    assert delta("nvckpt_bytes_written_total", tier="m-local") == sum(stored.values())
    assert delta("nvckpt_bytes_written_total", tier="m-shared") == stored[2] + stored[3]
    assert after[("nvckpt_last_step", (("tier", "m-local"),))] == 3
    assert after[("nvckpt_last_step", (("tier", "m-shared"),))] == 3
    assert delta("nvckpt_save_seconds_count", tier="m-local", phase="snapshot") == 3
    assert delta("nvckpt_save_seconds_count", tier="m-local", phase="write") == 3
    assert delta("nvckpt_save_seconds_count", tier="m-shared", phase="copy") == 2
    assert delta("nvckpt_training_blocked_seconds_total") > 0
    assert after[("nvckpt_ratio", ())] > 1.5  # the zeros compress well


def test_metrics_listen_on_this_machine_only_unless_an_address_is_given():
    # The default listening socket is bound to the loopback address: no other host can scrape (or probe) it.
    server, thread = nc.serve_metrics(0)
    try:
        host, port = server.socket.getsockname()[:2]
        assert host == "127.0.0.1"
        assert "nvckpt" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    # Every interface only when asked for, by address.
    server, thread = nc.serve_metrics(0, addr="0.0.0.0")
    try:
        assert server.socket.getsockname()[0] == "0.0.0.0"
    finally:
        server.shutdown()
        server.server_close()
