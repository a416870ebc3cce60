"""Engine-side statistics (plain counters and latency samples); the gateway exports them to Prometheus."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_batched_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    max_samples: int = 10000
    spec: Any = None             # core.spec.stats.SpecStats when speculative decoding is on

    def record_step(self, num_tokens: int, num_reqs: int) -> None:
        self.num_steps += 1
        self.num_batched_tokens += num_tokens

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft_s.append(seconds)
            del self.ttft_s[:-self.max_samples]

    def observe_e2e(self, seconds: float) -> None:
        with self.lock:
            self.e2e_s.append(seconds)
            del self.e2e_s[:-self.max_samples]
