"""Device slots of the vocabulary modules' LoRA (PEFT's `embed_tokens` / `lm_head` targets), beside the decoder
layers' (`slot_pool.py`), one per slot of the pool:

    embedding  `embed`: LoRAStack of one slice, A [1, slots, R, vocab] (PEFT's lora_embedding_A layout: the
               "shrink" of a token is a gather of its A column), B [slots, hidden, R]
    LM head    `lm_head`: LoRAStack of one slice, A [1, slots, R, hidden], B [slots, vocab, R], with DoRA's per-row
               scale / shift [slots, vocab] (DoRA on the embeddings is refused at load)

Allocated with the pool (the decode graphs capture their addresses): 2 * slots * max_rank * vocab elements of the
model dtype, plus the small A / B and 2 * slots * vocab fp32 for DoRA.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn

from adapters.adapter import LoRAModule
from adapters.errors import SlotPoolIntegrityError
from adapters.lora_ops import LoRAStack
from adapters.slots.dora_scales import base_weight, dora_scale_shift


def _stack(num_slots: int, max_rank: int, in_features: int, out_features: int, device: torch.device,
           dtype: torch.dtype, dora: bool) -> LoRAStack:
    kw = dict(device=device)
    d = {}
    if dora:
        d = dict(dora_scale=torch.ones(num_slots, out_features, dtype=torch.float32, **kw),
                 dora_shift=torch.zeros(num_slots, out_features, dtype=torch.float32, **kw),
                 dora_flags=torch.zeros(num_slots, dtype=torch.int32, **kw),
                 dora_host=torch.zeros(num_slots, dtype=torch.bool))
    return LoRAStack(torch.zeros(1, num_slots, max_rank, in_features, dtype=dtype, **kw),          # [1, slots, R, in]
                     torch.zeros(num_slots, out_features, max_rank, dtype=dtype, **kw),            # [slots, N, R]
                     torch.zeros(1, num_slots, dtype=torch.int32, **kw), torch.zeros(1, num_slots, **kw),
                     (0,), (out_features,), ranks_host=torch.zeros(1, num_slots, dtype=torch.int32),
                     scalings_host=torch.zeros(1, num_slots), **d)


class VocabSlots:
    def __init__(self, num_slots: int, max_rank: int, vocab_size: int, hidden_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.embed = _stack(num_slots, max_rank, vocab_size, hidden_size, device, dtype, dora=False)
        self.lm_head = _stack(num_slots, max_rank, hidden_size, vocab_size, device, dtype, dora=True)
        self.lm_head_base: Optional[nn.Module] = None   # the LM head a wrapper put LoRA on (DoRA's norms read it)

    def stack(self, name: str) -> LoRAStack:
        return self.embed if name == "embed_tokens" else self.lm_head

    def dora_scales(self, modules: Mapping[str, LoRAModule]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The LM head's DoRA (scale, shift) [vocab] of an adapter's vocabulary modules (None: no DoRA there)."""
        mod = modules.get("lm_head")
        if mod is None or not mod.is_dora:
            return None
        assert self.lm_head_base is not None, "DoRA on the LM head needs its wrapper"
        with torch.no_grad():
            return dora_scale_shift(base_weight(self.lm_head_base), None, mod)

    def clear(self, slot: int) -> None:
        for st in (self.embed, self.lm_head):
            st.lora_a[:, slot].zero_()
            st.lora_b[slot].zero_()
            for t in (st.ranks, st.scalings, st.ranks_host, st.scalings_host):
                assert t is not None
                t[:, slot] = 0
        st = self.lm_head
        assert st.dora_scale is not None and st.dora_shift is not None and st.dora_flags is not None
        st.dora_scale[slot] = 1.0
        st.dora_shift[slot] = 0.0
        st.dora_flags[slot] = 0
        st.dora_host[slot] = False  # type: ignore[index]

    def write(self, slot: int, modules: Mapping[str, LoRAModule], dora: Optional[tuple[torch.Tensor, torch.Tensor]],
              non_blocking: bool = False) -> None:
        """Copies an adapter's vocabulary modules into a slot `clear` emptied."""
        for name, mod in modules.items():
            st, r = self.stack(name), mod.rank
            st.lora_a[0, slot, :r].copy_(mod.lora_a, non_blocking=non_blocking)      # [r, in] (embedding: [r, vocab])
            st.lora_b[slot, :, :r].copy_(mod.lora_b, non_blocking=non_blocking)      # [out, r]
            st.ranks_host[0, slot] = r                                                # type: ignore[index]
            st.scalings_host[0, slot] = mod.scaling                                   # type: ignore[index]
            st.ranks[0, slot] = r
            st.scalings[0, slot] = mod.scaling
        if dora is not None:
            st = self.lm_head
            st.dora_scale[slot].copy_(dora[0], non_blocking=non_blocking)            # type: ignore[index]
            st.dora_shift[slot].copy_(dora[1], non_blocking=non_blocking)            # type: ignore[index]
            st.dora_host[slot] = True                                                 # type: ignore[index]
            st.dora_flags[slot] = 1                                                   # type: ignore[index]

    def check_integrity(self, slot_modules: list[Optional[Mapping[str, LoRAModule]]]) -> None:
        """Ranks, scalings and DoRA flags of every slot match its adapter's vocabulary modules (None: empty)."""
        for name in ("embed_tokens", "lm_head"):
            st = self.stack(name)
            assert st.ranks_host is not None and st.scalings_host is not None
            if not torch.equal(st.ranks.cpu(), st.ranks_host) or not torch.equal(st.scalings.cpu(), st.scalings_host):
                raise SlotPoolIntegrityError(f"{name}: device ranks/scalings differ from the host mirror")
            for slot, modules in enumerate(slot_modules):
                mod = (modules or {}).get(name)
                want = 0 if mod is None else mod.rank
                if int(st.ranks_host[0, slot]) != want:
                    raise SlotPoolIntegrityError(f"{name}: slot {slot} has rank {int(st.ranks_host[0, slot])}, "
                                                 f"its adapter {want}")
                dora = mod is not None and mod.is_dora
                if st.dora_host is not None and (bool(st.dora_host[slot]) != dora
                                                 or int(st.dora_flags[slot]) != int(dora)):  # type: ignore[index]
                    raise SlotPoolIntegrityError(f"{name}: slot {slot} DoRA flag does not match its adapter")
