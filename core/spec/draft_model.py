"""`method: "draft_model"`: a small model with the target's tokenizer proposes k tokens greedily.

The draft runs on its own weights (no adapter: a request of an adapter gets the base draft's proposals, so
its acceptance is what the base draft predicts of the adapted target) and its own paged KV pool: each
request has a shadow sequence (tokens, computed count, block table). Before proposing, the shadow is synced
with the request's tokens (the KV of the common prefix is kept, anything after it, such as the draft's own
rejected proposals, is recomputed), then one draft forward catches up every request's new tokens and k-1
single-token forwards extend them. Proposals are the draft's argmax (a one-hot q), so verification stays
exactly the output without speculation (`core/spec/verify.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from core.config import ModelConfig
from core.distributed.parallel_state import TPGroup
from core.distributed.rank_state import build_rank_model
from core.distributed.shard import TPShard
from core.kv.block_allocator import BlockAllocator
from core.kv.kv_cache_manager import cdiv
from core.models.loader import resolve_model_path
from core.models.rope import rope_row_offset
from core.engine.request import Request
from core.execution.runner import prepare_batch, to_device
from core.spec.config import SpeculativeConfig
from core.models.tokenizer_load import load_tokenizer


class DraftModelError(ValueError):
    """A draft model that cannot serve this target (the message says why)."""


@dataclass(eq=False)
class _Shadow:
    """The draft's view of one request (the attributes `prepare_batch` reads)."""
    req: Request
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    rope_offset: int = 0          # the draft's own longrope choice (core/models/rope.py)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def check_same_vocabulary(target_tok: Any, target_cfg: ModelConfig, draft_tok: Any, draft_cfg: ModelConfig) -> None:
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise DraftModelError(f"the draft model's vocabulary size {draft_cfg.vocab_size} differs from the "
                              f"target's {target_cfg.vocab_size}: draft_model needs the same tokenizer")
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise DraftModelError("the draft model's tokenizer maps tokens to different ids than the target's: "
                              "draft_model needs the same tokenizer")


class DraftProposer:
    def __init__(self, model: Any, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, max_positions: int) -> None:
        self.model, self.cfg, self.block_size, self.device = model, cfg, block_size, device
        self.max_positions = max_positions
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)       # [blocks, bs, Hkv, D]
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(cfg.num_layers)]
        self.allocator = BlockAllocator(num_blocks)
        self.shadows: dict[str, _Shadow] = {}

    @staticmethod
    def build(spec: SpeculativeConfig, config: Any, parts: Any) -> "DraftProposer":
        path = resolve_model_path(spec.model, None, config.download_dir)
        cfg = ModelConfig.from_path(path)
        check_same_vocabulary(parts.tokenizer, parts.model_config, load_tokenizer(path), cfg)
        model = build_rank_model(path, TPShard(cfg, 0, 1), TPGroup.single(), parts.device, parts.dtype,
                                 parts.max_model_len)   # whole, on the driver rank only
        return DraftProposer(model, cfg, parts.kv.num_blocks, config.cache.block_size, parts.device, parts.dtype,
                             parts.max_model_len)

    def release_finished(self) -> None:
        """Frees the shadows (and draft KV blocks) of requests that ended."""
        for rid in [rid for rid, sh in self.shadows.items() if sh.req.status.finished]:
            self.allocator.free(self.shadows.pop(rid).block_ids)

    def _sync(self, req: Request, k: int) -> _Shadow | None:
        """The request's shadow with its tokens and blocks for k more; None when the pool is full."""
        sh = self.shadows.get(req.request_id)
        if sh is None or sh.req is not req:
            if sh is not None:
                self.allocator.free(sh.block_ids)
            total = req.num_prompt_tokens + req.max_tokens
            sh = self.shadows[req.request_id] = _Shadow(req, rope_offset=rope_row_offset(self.cfg, self.max_positions,
                                                                                        total))
        tokens = req.all_token_ids
        common = 0
        for a, b in zip(sh.all_token_ids, tokens):
            if a != b:
                break
            common += 1
        sh.all_token_ids = list(tokens)
        sh.num_computed_tokens = min(sh.num_computed_tokens, common, len(tokens) - 1)
        num_needed = cdiv(len(tokens) + k - 1, self.block_size) - len(sh.block_ids)
        if num_needed > 0:
            if not self.allocator.can_allocate(num_needed):
                return None
            sh.block_ids += self.allocator.allocate(num_needed)
        return sh

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        shadows = [self._sync(r, k) for r, k in zip(reqs, ks)]
        out: dict[int, list[int]] = {id(sh): [] for sh in shadows if sh is not None}
        want = {id(sh): k for sh, k in zip(shadows, ks) if sh is not None}
        live = [sh for sh in shadows if sh is not None]
        while live:
            host = prepare_batch([(sh, sh.num_tokens - sh.num_computed_tokens) for sh in live], self.block_size)
            batch = to_device(host, self.block_size, self.device)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)    # [T, hidden]
            tokens = self.model.compute_logits(hidden[batch.logits_indices]).argmax(dim=-1).tolist()
            for i, token in zip(host.samples, tokens):
                sh = host.requests[i]
                sh.num_computed_tokens = sh.num_tokens
                sh.all_token_ids.append(token)
                out[id(sh)].append(token)
            live = [sh for sh in live if len(out[id(sh)]) < want[id(sh)]]
        return [out[id(sh)] if sh is not None else [] for sh in shadows]
