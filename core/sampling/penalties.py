"""Sampling penalties, logit bias, min_tokens, allowed ids and bad words, batched on the device (CPU and GPU).

Each request that carries a penalty or a bias owns a row ("slot") of persistent device tensors:
output-token counts `[S, V]` int32, prompt-token presence `[S, V]` bool and its bias `[S, 300]` (ids, values).
A row is filled once, when the request is first sampled; afterwards each step adds the sampled tokens to
their rows on the device (one `index_put_`), so a step never rebuilds counts from Python lists. Slot 0 is a
neutral row (all zeros) for the batch's rows without penalties. A row whose host token count disagrees with
its device count (a token dropped by error recovery) is rebuilt from the host lists.

Semantics: bias added to the logit, then repetition as HF/vLLM (over prompt and output tokens: a positive
logit is divided by the penalty, another multiplied), then presence/frequency as OpenAI (over output tokens). None of
these can lift a logit from -inf, so applying them after the grammar mask equals applying the mask last. Last,
the allowed ids (vLLM's `allowed_token_ids`, a device mask per request), then the bans (min_tokens' EOS and stop
tokens, the tokens that would complete a bad word: bad_words.py) set logits to -inf. Each gives way where it would
leave a row nothing to sample: allowed ids that a grammar state excludes (the grammar's tokens stay, so a
constrained answer stays valid), then bans that cover every token left (the allowed ids, or the grammar's, stay).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.engine import faults
from core.engine.request import Request
from core.sampling.bad_words import banned_by_bad_words
from core.sampling.params import MAX_LOGIT_BIAS
from core.engine.fault_isolation import check_ids


@dataclass
class PenaltyBatch:
    """One step's per-row parameters (rows = the sampled requests, in order)."""

    slots: torch.Tensor             # [N] int64 rows of the state (0 = neutral)
    counted: torch.Tensor           # [N] int32: 1 where the sampled token is added to its row's counts
    presence: torch.Tensor          # [N, 1] float32
    frequency: torch.Tensor         # [N, 1] float32
    repetition: torch.Tensor        # [N, 1] float32
    ban_rows: torch.Tensor          # [K] int64: (row, token) pairs masked by min_tokens and bad words
    ban_tokens: torch.Tensor        # [K] int64
    allowed_rows: torch.Tensor      # [R] int64: the rows with allowed_token_ids
    allowed_masks: torch.Tensor | None   # [R, V] bool: True where the row may sample
    need_counts: bool
    need_repetition: bool
    bias_width: int                 # 0 = no row has a bias


def _bans(reqs: list[Request], vocab_size: int) -> tuple[list[int], list[int]]:
    """(row, token) pairs banned this step: min_tokens' EOS and stop tokens, bad words' next tokens."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if r.status.finished:
            continue
        banned: set[int] = set()
        if r.num_output_tokens < p.min_tokens:
            check_ids(p.stop_token_ids, vocab_size, "stop_token_ids")
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        if p.bad_words_token_ids:   # (their ids are checked once, when the row's slot is taken: `_slot`)
            banned |= banned_by_bad_words(r.output_token_ids, p.bad_words_token_ids)
        rows += [i] * len(banned)
        tokens += sorted(banned)
    return rows, tokens


def _empty(x: torch.Tensor) -> torch.Tensor:
    """[N, 1] True for the rows of `x` [N, V] with nothing left to sample."""
    return torch.isneginf(x).all(dim=-1, keepdim=True)


class PenaltyState:
    """The device rows of the requests with penalties or a bias; `prepare` -> `apply` -> `record` per step."""

    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)                 # [S, V]
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)               # [S, V]
        self.bias_ids = torch.zeros(0, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)           # [S, B]
        self.bias_vals = torch.zeros(0, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)        # [S, B]
        self._free: list[int] = []                 # slot 0 is the neutral row, never handed out
        self._grow(initial_slots)
        self._slot_of: dict[str, int] = {}          # request id -> slot
        self._num_counted: dict[str, int] = {}      # request id -> output tokens its device row holds
        self._bias_len: dict[str, int] = {}
        self._allowed: dict[str, torch.Tensor] = {}   # request id -> [V] bool, for allowed_token_ids

    @property
    def num_slots(self) -> int:
        return self.counts.shape[0]

    def _grow(self, num_slots: int) -> None:
        extra = num_slots - self.num_slots
        self._free = list(range(num_slots - 1, max(self.num_slots, 1) - 1, -1)) + self._free
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab_size)])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(extra, self.vocab_size)])
        self.bias_ids = torch.cat([self.bias_ids, self.bias_ids.new_zeros(extra, MAX_LOGIT_BIAS)])
        self.bias_vals = torch.cat([self.bias_vals, self.bias_vals.new_zeros(extra, MAX_LOGIT_BIAS)])

    def release(self, request_id: str) -> None:
        """Frees a finished request's row (its contents are reset when the row is next taken)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._num_counted.pop(request_id)
            self._bias_len.pop(request_id)
            self._allowed.pop(request_id, None)
            self._free.append(slot)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)

    def _fill(self, req: Request, slot: int) -> None:
        """(Re)writes a row from the host lists: counts of the output tokens, prompt presence, bias."""
        self.counts[slot].zero_()
        if req.output_token_ids:
            self.counts[slot].index_put_((self._ids(req.output_token_ids),),
                                         torch.ones((), dtype=torch.int32, device=self.device), accumulate=True)
        self.in_prompt[slot].zero_()
        self.in_prompt[slot, self._ids(req.prompt_token_ids)] = True
        bias = req.sampling_params.logit_bias
        self.bias_ids[slot].zero_()
        self.bias_vals[slot].zero_()
        if bias:
            self.bias_ids[slot, :len(bias)] = self._ids([t for t, _ in bias])
            self.bias_vals[slot, :len(bias)] = torch.tensor([b for _, b in bias], dtype=torch.float32).to(
                self.device, non_blocking=True)     # (a blocking copy would wait for the queued forward)
        self._num_counted[req.request_id] = len(req.output_token_ids)
        self._bias_len[req.request_id] = len(bias)

    def _slot(self, req: Request) -> int:
        rid = req.request_id
        slot = self._slot_of.get(rid)
        if slot is None:
            check_ids(req.prompt_token_ids, self.vocab_size, "prompt")
            check_ids([t for t, _ in req.sampling_params.logit_bias], self.vocab_size, "logit_bias")
            # bad words: checked here, once per request (up to ~250k ids: every step would cost milliseconds)
            check_ids([t for w in req.sampling_params.bad_words_token_ids for t in w], self.vocab_size, "bad_words")
            allowed = req.sampling_params.allowed_token_ids
            if allowed is not None:
                check_ids(allowed, self.vocab_size, "allowed_token_ids")
            if not self._free:
                self._grow(2 * self.num_slots)
            slot = self._slot_of[rid] = self._free.pop()
            if allowed is not None:   # (after the slot is owned: `release` frees the mask with it)
                mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)             # [V]
                mask[self._ids(list(allowed))] = True
                self._allowed[rid] = mask
            self._fill(req, slot)
        elif self._num_counted[rid] != len(req.output_token_ids):
            self._fill(req, slot)
        return slot

    def prepare(self, reqs: list[Request]) -> PenaltyBatch | None:
        """Host side: None when no row has penalties, a bias, allowed ids, bad words or a pending min_tokens (the
        plain sampler runs)."""
        if faults.ACTIVE:
            faults.hit_any("penalties", reqs)
        live = [bool(r.sampling_params.has_penalties and not r.status.finished) for r in reqs]
        # the slots first: taking one checks the request's ids (bad words' among them) before any is used
        slots = [self._slot(r) if on else 0 for r, on in zip(reqs, live)]
        ban_rows, ban_tokens = _bans(reqs, self.vocab_size)
        if not any(live) and not ban_rows:
            return None
        allowed = [i for i, (r, on) in enumerate(zip(reqs, live)) if on and r.request_id in self._allowed]
        ps = [r.sampling_params for r in reqs]
        floats = torch.tensor([[p.presence_penalty for p in ps], [p.frequency_penalty for p in ps],
                               [p.repetition_penalty for p in ps]], dtype=torch.float32)           # [3, N]
        ints = torch.tensor(slots + [int(on) for on in live] + ban_rows + ban_tokens, dtype=torch.int64)
        if self.device.type == "cuda":
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats, ints = floats.to(self.device, non_blocking=True), ints.to(self.device, non_blocking=True)
        n, k = len(reqs), len(ban_rows)
        for r, on in zip(reqs, live):
            if on:
                self._num_counted[r.request_id] += 1    # the token sampled now is added on the device (`record`)
        return PenaltyBatch(
            slots=ints[:n], counted=ints[n:2 * n].to(torch.int32), presence=floats[0, :, None],
            frequency=floats[1, :, None], repetition=floats[2, :, None],
            ban_rows=ints[2 * n:2 * n + k], ban_tokens=ints[2 * n + k:],
            allowed_rows=self._ids(allowed),
            allowed_masks=torch.stack([self._allowed[reqs[i].request_id] for i in allowed]) if allowed else None,
            need_counts=any(p.presence_penalty or p.frequency_penalty for p in ps),
            need_repetition=any(p.repetition_penalty != 1.0 for p in ps),
            bias_width=max((self._bias_len.get(r.request_id, 0) for r, on in zip(reqs, live) if on), default=0))

    def apply(self, logits: torch.Tensor, batch: PenaltyBatch) -> torch.Tensor:
        """logits [N, V] float32 -> a new tensor: bias, then repetition, then frequency/presence (vLLM's order),
        then the bans and the allowed ids. The input (the model's distribution, for logprobs) is left as it was."""
        x = logits.clone()
        if batch.bias_width:
            x.scatter_add_(1, self.bias_ids.index_select(0, batch.slots)[:, :batch.bias_width],      # [N, B]
                           self.bias_vals.index_select(0, batch.slots)[:, :batch.bias_width])
        if batch.need_counts or batch.need_repetition:
            counts = self.counts.index_select(0, batch.slots)                                     # [N, V]
            in_output = counts > 0
            if batch.need_repetition:
                seen = in_output | self.in_prompt.index_select(0, batch.slots)                    # [N, V]
                penalized = torch.where(x > 0, x / batch.repetition, x * batch.repetition)
                x = torch.where(seen, penalized, x, out=x)
            if batch.need_counts:
                x.sub_(counts * batch.frequency).sub_(in_output * batch.presence)
        # (the -inf filled on the device: torch.tensor(value, device=cuda) is a blocking copy from the host)
        neg_inf = x.new_full((), float("-inf"))
        if batch.allowed_masks is not None:
            allowed = x.clone()                                                                       # [N, V]
            rows = x.index_select(0, batch.allowed_rows)                                              # [R, V]
            allowed.index_copy_(0, batch.allowed_rows, rows.masked_fill(~batch.allowed_masks, neg_inf))
            # a grammar state none of whose tokens is allowed keeps the grammar's tokens
            x = torch.where(_empty(allowed), x, allowed)
        if batch.ban_rows.numel():
            banned = x.index_put((batch.ban_rows, batch.ban_tokens), neg_inf)                         # [N, V]
            # never leave a row with nothing to sample (a grammar state, or allowed ids, that only banned tokens
            # fit): the row keeps what the grammar and the allowed ids left
            x = torch.where(_empty(banned), x, banned)
        return x

    def record(self, batch: PenaltyBatch, tokens: torch.Tensor) -> None:
        """Adds the sampled tokens [N] to their rows' counts, on the device (neutral rows add 0)."""
        self.counts.index_put_((batch.slots, tokens), batch.counted, accumulate=True)

    def check_integrity(self) -> None:
        used = set(self._slot_of.values())
        assert 0 not in used and not used & set(self._free), "a slot is both free and owned"
        assert len(used) + len(self._free) == self.num_slots - 1, "a lost penalty slot"
        assert set(self._allowed) <= set(self._slot_of), "an allowed-ids mask outlived its request's slot"
