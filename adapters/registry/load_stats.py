"""Counters of adapter loads (by outcome) and a load-latency histogram, read by the gateway's /metrics."""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

LOAD_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OUTCOMES = ("success", "error", "discarded")   # discarded: unloaded while its load ran


@dataclass
class LoadStats:
    num_by_outcome: dict[str, int] = field(default_factory=lambda: {o: 0 for o in OUTCOMES})
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS_S) + 1))
    sum_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, outcome: str, seconds: float) -> None:
        assert outcome in self.num_by_outcome, outcome
        with self._lock:
            self.num_by_outcome[outcome] += 1
            self.bucket_counts[bisect.bisect_left(LOAD_BUCKETS_S, seconds)] += 1
            self.sum_s += seconds

    def snapshot(self) -> tuple[dict[str, int], list[tuple[str, int]], float]:
        """(loads by outcome, cumulative (le, count) buckets ending with +Inf, sum of seconds)."""
        with self._lock:
            counts, buckets, total = dict(self.num_by_outcome), list(self.bucket_counts), self.sum_s
        cumulative, acc = [], 0
        for le, n in zip([*map(str, LOAD_BUCKETS_S), "+Inf"], buckets):
            acc += n
            cumulative.append((le, acc))
        return counts, cumulative, total
