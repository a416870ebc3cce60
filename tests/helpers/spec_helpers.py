"""Helpers of the speculative decoding tests: an engine with n-gram drafts, an oracle proposer and a radix-cache
content check."""
from __future__ import annotations

import random
from pathlib import Path

from core import SamplingParams
from core.config import CacheConfig, EngineConfig, SchedulerConfig
from core.engine.engine import LLMEngine
from core.engine.request import Request
from core.spec import SpeculativeConfig
from testlib import PROMPTS, encode

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
NGRAM4 = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})


def make_engine(path: Path, num_blocks: int = 256, budget: int = 2048, prefix: bool = True,
                spec: SpeculativeConfig | None = NGRAM4) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(path), dtype="float32", device="cpu", speculative=spec,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def prompts_for(path: Path, num: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [encode(path, p) for p in PROMPTS]
    return [base[i % len(base)] + [rng.randrange(10, 500) for _ in range(rng.randint(0, 30))] for i in range(num)]


class OracleDrafts:
    """Proposes a known continuation (the output without speculation), wrong at some positions, so that
    random tiny models (which the n-gram proposer rarely predicts) exercise full accepts, partial rejects
    and bonus tokens. Keyed by (adapter name or None, prompt) -> output token ids."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.refs: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}
        self.num_calls = 0

    def release_finished(self) -> None:
        pass

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, ks):
            self.num_calls += 1
            name = req.lora_slot_key.name if req.lora_slot_key is not None else None
            ref = self.refs.get((name, tuple(req.prompt_token_ids)), [])
            m = req.num_output_tokens
            drafts = list(ref[m:m + k])
            if drafts and self.num_calls % 3 == 1:       # a wrong token in the middle: a partial accept
                wrong = self._wrong_token(req, drafts, len(drafts) // 2)
                if wrong is not None:
                    drafts[wrong[0]] = wrong[1]
            out.append(drafts)
        return out

    def _wrong_token(self, req: Request, drafts: list[int], j: int) -> tuple[int, int] | None:
        """(position, token): a token other than the reference at position j or later. Under a grammar, one the
        grammar allows there: the engine cuts drafts at the first forbidden token, so a forbidden wrong token
        would never be verified, and whether rejects happen would depend on the device's numerics (which JSON
        the random model writes); a grammar that forces every position gets no wrong token."""
        matcher = req.grammar
        compiled = getattr(matcher, "compiled", None)
        if matcher is None or not hasattr(matcher, "state") or not hasattr(compiled, "next_state"):
            return j, (drafts[j] + 1) % self.vocab_size
        state = matcher.state
        for i, token in enumerate(drafts):
            if i >= j:
                for step in range(1, self.vocab_size):
                    cand = (token + step) % self.vocab_size
                    if compiled.next_state(state, cand) is not None:
                        return i, cand
            state = compiled.next_state(state, token)
            if state is None:
                return None
        return None


def cached_sequences(kv) -> list[tuple[str, list[int]]]:
    """Every root-to-node token sequence held by the radix tree, with its namespace."""
    cache = kv.prefix_cache
    out = []
    for node in cache._nodes():
        tokens: list[int] = []
        n = node
        while n is not None and n.parent is not None:
            tokens = list(n.tokens) + tokens
            n = n.parent
        ns = next((name for name, root in cache.roots.items() if root is n), None)
        out.append((ns, tokens))
    return out


def assert_cache_holds_only_real_tokens(kv, sequences: list[tuple[str, list[int]]]) -> None:
    """Every cached sequence is a prefix of some request's prompt + output in its namespace."""
    for ns, tokens in cached_sequences(kv):
        assert any(ns == n and seq[:len(tokens)] == tokens for n, seq in sequences), (ns, tokens)


def record_step_inputs(monkeypatch) -> list:
    """Records every `StepInputs` the tensor-parallel driver sends its workers (a list that fills as it runs)."""
    from core.distributed.step_inputs import StepInputs

    sent: list[StepInputs] = []
    real = StepInputs.from_host

    def from_host(*args, **kw) -> StepInputs:
        sent.append(real(*args, **kw))
        return sent[-1]
    monkeypatch.setattr(StepInputs, "from_host", staticmethod(from_host))
    return sent
