"""The ordering rules of the pinned buffer ring that bounds GPU batches in flight (CPU-testable)."""

from __future__ import annotations

import threading
import time

from nvcomp_checkpoint.writer import PinnedRing


def _start(ring: PinnedRing, seq: int, started: list[int]) -> threading.Thread:
    def run() -> None:
        ring.acquire(seq)
        started.append(seq)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_batch_waits_until_the_batch_slots_earlier_is_written():
    ring = PinnedRing(slots=2)
    seqs = [ring.ticket() for _ in range(4)]
    assert seqs == [0, 1, 2, 3]
    started: list[int] = []
    threads = [_start(ring, s, started) for s in seqs]
    for t in threads[:2]:
        t.join(60)  # batches 0 and 1 have slots: they start at once, however loaded the machine
    time.sleep(0.2)  # a chance for 2 and 3 to start, which they must not take
    assert sorted(started) == [0, 1]  # 2 and 3 wait for their slots
    ring.written()  # batch 0 is on the stream
    threads[2].join(60)
    time.sleep(0.05)
    assert sorted(started) == [0, 1, 2]
    ring.written()
    threads[3].join(60)
    assert sorted(started) == [0, 1, 2, 3]


def test_abort_releases_every_waiting_batch():
    ring = PinnedRing(slots=1)
    seqs = [ring.ticket() for _ in range(5)]
    started: list[int] = []
    threads = [_start(ring, s, started) for s in seqs]
    threads[0].join(60)
    time.sleep(0.2)  # a chance for the others to start, which they must not take
    assert started == [0]
    ring.abort()
    for t in threads:
        t.join(60)
    assert sorted(started) == seqs
