"""benchmarks/serving_client.py's bootstrap intervals, which latency_slo.py prints beside its target ratios: they
hold the ratio measured on the whole sample, narrow as the sample grows, and resample requests, not gaps."""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from serving_client import itl_tail_interval, median_ratio_interval, pct  # noqa: E402


def test_the_median_ratio_interval_holds_the_ratio_and_narrows() -> None:
    rng = random.Random(0)
    widths = []
    for n in (48, 480):
        a = [rng.lognormvariate(0.0, 0.6) * 2.0 for _ in range(n)]
        b = [rng.lognormvariate(0.0, 0.6) for _ in range(n)]
        lo, hi = median_ratio_interval(a, b)
        assert lo <= pct(a, 0.5) / pct(b, 0.5) <= hi
        widths.append(hi - lo)
    assert widths[1] < 0.5 * widths[0]
    assert median_ratio_interval([], [1.0]) == []


def test_the_tail_interval_resamples_requests() -> None:
    """One request whose gaps are all slow: resampling requests, some resamples leave it out (a low ratio) and some
    take it twice (a high one); resampling gaps one by one would hide that it is a single request."""
    rng = random.Random(1)
    requests = [{"itl": [0.02 * rng.uniform(0.9, 1.1) for _ in range(100)]} for _ in range(30)]
    requests.append({"itl": [0.2] * 100})
    lo, hi = itl_tail_interval(requests)
    assert lo < 2.0 < hi
    assert itl_tail_interval(requests[:3]) == []
