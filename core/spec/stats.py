"""Speculative decoding counters (vLLM's names): drafts proposed, drafts accepted, acceptance per position."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_speculative_tokens: int
    num_drafts: int = 0                   # verification runs (one per request and step with drafts)
    num_draft_tokens: int = 0             # proposed tokens that were verified
    num_accepted_tokens: int = 0          # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)   # [k]: runs accepting position j
    num_forced_tokens: int = 0            # jump-forward: tokens the grammar forced (counted in the two above)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification run: 1 (the target's own token) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_per_position(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]
